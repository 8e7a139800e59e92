-- annotate: add a note to the history entry a run's publish wrote, for an
-- operator's action that published the run through the gate (a re-enqueue
-- names who asked for it, and which run it repeats).
--
-- KEYS[1]  record: the member's status record (HASH; its history in fields h<n>, see lib)
-- ARGV[1]  task_id: the run's task id
-- ARGV[2]  note
-- ARGV[3]  history_len: history length (0: histories are off, nothing is written)
--
-- Only while the record names that run: once another run owns the key, a
-- note would tell its history something false. The note goes on the run's
-- oldest entry (the one its publish wrote), after a note it already has, cut
-- to keep the entry within lib's HISTORY_VALUE_MAX; if that entry is gone
-- (pushed out of the history), an entry "<offset> <state> - <note>" is added
-- instead.
--
-- Returns 1 when noted, 0 when the record names another run (or there is
-- none) or histories are off.

local record = KEYS[1]

local current = redis.call('HMGET', record, 'task_id', 'state', 'hn', 'queued_at')
if current[1] ~= task_id or history_len <= 0 then
  return 0
end

local hn = tonumber(current[3] or 0)
for n = math.max(0, hn - history_len), hn - 1 do
  local value = redis.call('HGET', record, 'h' .. n)
  local offset, state, run, old_note = false, nil, nil, nil
  if value then
    offset, state, run, old_note = parse_history(value)
  end
  if offset and run == '-' then
    local text = note
    if old_note ~= '' then
      text = old_note .. '; ' .. note
    end
    redis.call('HSET', record, 'h' .. n, history_value(offset, state, '-', text))
    return 1
  end
end

local now = now_ms()
local queued_at = tonumber(current[4])
local fields = {}
if not queued_at then
  queued_at = now
  fields[1], fields[2] = 'queued_at', now
end
push_history(record, hn, history_value(now - queued_at, current[2] or '', '-', note), history_len, fields)
redis.call('HSET', record, unpack(fields))
return 1
