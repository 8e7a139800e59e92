-- confirm: the second step of the two-phase gate. The broker took the message
-- of a run that gate.lua holds in state `publishing`: give the key its full hold.
--
-- KEYS[1]  held: held set
-- KEYS[2]  record: the member's status record (HASH)
-- ARGV[1]  member
-- ARGV[2]  task_id: task id of the run
-- ARGV[3]  nonce: publish nonce of that run's hold
-- ARGV[4]  hold_ms: hold from now (as gate.lua's hold_ms)
-- ARGV[5]  grace_ms: record grace
-- ARGV[6]  prefix: key prefix
-- ARGV[7]  history_len: history length
--
-- A confirm can come late: after a worker started (or ended) the run, which
-- then owns its record, or whose record has passed to a newer run since (the
-- record remembers it: lib's `ended` and `began`); after the reaper declared
-- the run lost when its lease ended (the run is queued after all, and gets its
-- hold back); or after the lease ended and another call took the key over
-- before this run's message was seen, whose run then stands for this call (the
-- guard skips this run's delivery: start.lua's "superseded").
--
-- Returns {code, task id}:
--   {1, task_id}  confirmed: the record says `queued`, the key is held for hold_ms
--   {2, task_id}  nothing to do: the run began or ended before its confirm,
--                 whether or not the key has passed to a newer run since (or
--                 this is not the publish that holds it)
--   {0, owner}    the key passed to run `owner` (or to no run: owner "") while
--                 this run had not begun; this run's message will not run

local held, record = KEYS[1], KEYS[2]

local current = redis.call('HMGET', record, 'task_id', 'state', 'nonce', 'started_at', 'ended', 'began')
if current[1] ~= task_id then
  local ended, began = current[5], current[6]
  if (ended and has_ended(prefix, member, ended, task_id)) or (began and has_begun(began, task_id)) then
    return {2, task_id}
  end
  return {0, current[1] or ''}
end
-- The reaper may have declared the run lost when its lease ended: it is not.
local waiting = current[2] == 'publishing' or (current[2] == 'lost' and not current[4])
if not waiting or current[3] ~= nonce then
  return {2, task_id}
end
local now = now_ms()
redis.call('SADD', held, member)
redis.call('HSET', record, 'held_until', now + hold_ms, 'pushed_at', now)
redis.call('HDEL', record, 'finished_at', 'hold_ms')
transition(prefix, record, member, 'queued', now, '', history_len, current[2])
expire_record(record, hold_ms + grace_ms)
return {1, task_id}
