-- annotate: add a note to the history entry a run's publish wrote, for an
-- operator's action that published the run through the gate (a re-enqueue
-- names who asked for it, and which run it repeats).
--
-- KEYS[1]  record: the member's status record (HASH)
-- KEYS[2]  hist: the member's history (LIST of "<ms> <state> <task id> [note]", newest first)
-- ARGV[1]  task_id: the run's task id
-- ARGV[2]  note
-- ARGV[3]  history_len: history length (0: histories are off, nothing is written)
--
-- Only while the record names that run: once another run owns the key, a
-- note would tell its history something false. The note goes on the run's
-- oldest entry (the one its publish wrote), after a note it already has; if
-- that entry is gone (trimmed, or the history expired), one entry
-- "<now> <state> <task id> <note>" is pushed instead.
--
-- Returns 1 when noted, 0 when the record names another run (or there is
-- none) or histories are off.

local record, hist = KEYS[1], KEYS[2]

local current = redis.call('HMGET', record, 'task_id', 'state')
if current[1] ~= task_id or history_len <= 0 then
  return 0
end

local entries = redis.call('LRANGE', hist, 0, -1)
for i = #entries, 1, -1 do
  local head, id, rest = string.match(entries[i], '^(%S+ %S+) (%S+)(.*)$')
  if id == task_id then
    local separator = ' '
    if rest ~= '' then
      separator = '; '
    end
    redis.call('LSET', hist, i - 1, head .. ' ' .. id .. rest .. separator .. note)
    return 1
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('LPUSH', hist, now .. ' ' .. (current[2] or '') .. ' ' .. task_id .. ' ' .. note)
redis.call('LTRIM', hist, 0, history_len - 1)
local ttl = redis.call('PTTL', record)
if ttl > 0 then
  redis.call('PEXPIRE', hist, ttl)
end
return 1
