-- takeover: free an execution lock whose owner is provably dead, so that the
-- delivery it refused can start at once (the caller runs start.lua again).
-- Only a process that shares the owner's process table can prove the death
-- (processes.owner_gone); this script trusts the caller for that and checks
-- only that the lock still holds the dead owner's token.
--
-- KEYS[1]  record: the member's status record (HASH)
-- KEYS[2]  lock: the member's execution lock
-- ARGV[1]  member
-- ARGV[2]  dead: the dead owner's token
-- ARGV[3]  prefix: key prefix
-- ARGV[4]  history_len: history length
-- ARGV[5]  refused: the decision start.lua counted when it refused the delivery
--          ("deferred" or "skipped"): uncounted, as the delivery goes on
--
-- Returns 1 when taken over: the lock is deleted, counted as `taken_over`,
-- and a record whose started run held that lock moves to `lost`, its history
-- saying "taken over from <token>"; 0 (nothing changed) when the lock no
-- longer holds that token (released, expired, or another delivery's now).

local record, lock = KEYS[1], KEYS[2]

if redis.call('GET', lock) ~= dead then
  return 0
end
redis.call('DEL', lock)
count(prefix, member, 'taken_over')
count(prefix, member, refused, -1)
local current = redis.call('HMGET', record, 'task_id', 'state', 'lock')
if current[1] then
  redis.call('HINCRBY', record, 'skipped', -1)  -- start.lua counted the refusal there too
end
if current[2] == 'started' and current[3] == dead then
  transition(prefix, record, member, 'lost', now_ms(), 'taken over from ' .. dead, history_len,
    'started')
end
return 1
