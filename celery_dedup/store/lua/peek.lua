-- peek: answer a duplicate before its message is built.
--
-- KEYS[1]  held: held set
-- KEYS[2]  record: the member's status record (HASH)
-- ARGV[1]  member
-- ARGV[2]  prefix: key prefix (for the decision counters)
-- ARGV[3]  args_fp: the call's arguments fingerprint, "" for none (as gate.lua's)
--
-- The same test as gate.lua's duplicate branch: the member is held and its
-- record names a run whose hold has not passed. Then the record's duplicate
-- counter is incremented, and a fingerprint that differs from the run's is
-- counted, as the gate would.
--
-- Returns {0, owner, fp} for a duplicate of run `owner`, whose arguments
-- fingerprint is fp ("" for none); {-1, ""} when the key is free (or stale):
-- the caller runs the gate, which decides.

local held, record = KEYS[1], KEYS[2]
if redis.call('SISMEMBER', held, member) == 0 then
  return {-1, ''}
end
local owner = redis.call('HMGET', record, 'task_id', 'held_until', 'args_fp')
if not owner[1] or tonumber(owner[2] or 0) <= now_ms() then
  return {-1, ''}
end
local owner_fp = owner[3] or ''
redis.call('HINCRBY', record, 'duplicates', 1)
count(prefix, member, 'deduplicated')
note_mismatch(prefix, record, member, args_fp, owner_fp)
return {0, owner[1], owner_fp}
