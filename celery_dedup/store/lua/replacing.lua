-- replacing: mark a running run as replacing itself (Task.replace), before its
-- replacement is published.
--
-- KEYS[1]  record: the member's status record (HASH)
-- KEYS[2]  lock: the member's execution lock
-- ARGV[1]  task_id: task id of the run
-- ARGV[2]  token: the running delivery's lock token
-- ARGV[3]  by: what replaces it (a task or canvas name), for people
--
-- The replacement carries the run's id and relays its ending to the run's
-- followers (relay.py). Should the run be declared `lost` before it records
-- `replaced` (its worker died around the publish), the record's `replacing`
-- tells lib's settle_followers that a replacement may be on its way: its
-- followers wait for its ending instead of failing at once. A replacement
-- that goes on as the same run takes the mark away (finish.lua, `queued`).
--
-- Only the delivery holding the run's lock marks it, while the record names
-- the run.
--
-- Returns 1 when marked, 0 otherwise.

local record, lock = KEYS[1], KEYS[2]
if redis.call('HGET', record, 'task_id') ~= task_id or redis.call('GET', lock) ~= token then
  return 0
end
redis.call('HSET', record, 'replacing', by)
return 1
