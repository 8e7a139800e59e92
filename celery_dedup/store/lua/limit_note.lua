-- limit_note: tell a run's status record that it waits for its group's limits,
-- or how long it waited once it got through.
--
-- KEYS[1]  record: the member's status record (HASH; its history in fields h<n>, see lib)
-- ARGV[1]  task_id: nothing is written unless the record names this run
-- ARGV[2]  what: "wait" or "granted"
-- ARGV[3]  detail: wait, why and for how long, for `limit_wait` and the history; granted, waited ms
-- ARGV[4]  history_len: history length
--
-- Fields: `limit_wait` (why the run waits now; removed when it gets through),
-- `waiting_since` (ms, its first refusal; removed then too), `limit_waits` (refusals),
-- `waited_ms` (its last wait, from first arrival to getting through).
-- History: one entry per wait ("<offset> <state> - waiting: <why>", cut to
-- lib's HISTORY_VALUE_MAX).
-- Returns 1 if the record was written, else 0.

local record = KEYS[1]

if redis.call('HGET', record, 'task_id') ~= task_id then
  return 0
end
local now = now_ms()
if what == 'wait' then
  local fields = {'limit_wait', detail}
  if redis.call('HSETNX', record, 'waiting_since', now) == 1 and history_len > 0 then
    local r = redis.call('HMGET', record, 'state', 'hn', 'queued_at')
    local queued_at = tonumber(r[3])
    if not queued_at then
      queued_at = now
      fields[#fields + 1], fields[#fields + 2] = 'queued_at', now
    end
    push_history(record, tonumber(r[2] or 0), history_value(now - queued_at, r[1] or 'queued', '-', 'waiting: ' .. detail),
      history_len, fields)
  end
  redis.call('HSET', record, unpack(fields))
  redis.call('HINCRBY', record, 'limit_waits', 1)
else
  redis.call('HSET', record, 'waited_ms', detail)
  redis.call('HDEL', record, 'limit_wait', 'waiting_since')
end
return 1
