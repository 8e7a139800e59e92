-- limit_note: tell a run's status record that it waits for its group's limits,
-- or how long it waited once it got through.
--
-- KEYS[1]  record: the member's status record (HASH)
-- KEYS[2]  history: the member's history (LIST, newest first; see lib.lua)
-- ARGV[1]  task_id: nothing is written unless the record names this run
-- ARGV[2]  what: "wait" or "granted"
-- ARGV[3]  detail: wait, why and for how long, for `limit_wait` and the history; granted, waited ms
-- ARGV[4]  history_len: history length
--
-- Fields: `limit_wait` (why the run waits now; removed when it gets through),
-- `waiting_since` (ms, its first refusal; removed then too), `limit_waits` (refusals),
-- `waited_ms` (its last wait, from first arrival to getting through).
-- History: one entry per wait ("<ms> queued <task id> waiting: <why>").
-- Returns 1 if the record was written, else 0.

local record, history = KEYS[1], KEYS[2]

if redis.call('HGET', record, 'task_id') ~= task_id then
  return 0
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
if what == 'wait' then
  if redis.call('HSETNX', record, 'waiting_since', now) == 1 and history_len > 0 then
    local state = redis.call('HGET', record, 'state') or 'queued'
    redis.call('LPUSH', history, now .. ' ' .. state .. ' ' .. task_id .. ' waiting: ' .. detail)
    redis.call('LTRIM', history, 0, history_len - 1)
  end
  redis.call('HSET', record, 'limit_wait', detail)
  redis.call('HINCRBY', record, 'limit_waits', 1)
else
  redis.call('HSET', record, 'waited_ms', detail)
  redis.call('HDEL', record, 'limit_wait', 'waiting_since')
end
return 1
