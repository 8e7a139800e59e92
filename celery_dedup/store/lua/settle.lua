-- settle: hand how a run ended to its followers and release them.
--
-- KEYS[1]  the member's followers (HASH, P:fol:M; see keys.py)
-- ARGV[1]  member
-- ARGV[2]  task id of the run
-- ARGV[3]  its return value (gate.result_payload), or "" with ARGV[4]
-- ARGV[4]  why the value could not be kept, or the error it ended with ("" when
--          ARGV[3] is given): followers then fail with it
-- ARGV[5]  key prefix
-- ARGV[6]  how long the outcome is kept for followers still to come, ms
-- ARGV[7]  how the run ended: "succeeded" (default) or another state of lib's ENDED
--
-- Two callers. finish.lua asks for this (wants_result) when a run succeeded
-- and has followers; between the two calls nothing can resolve them, as their
-- messages are only pushed here. And a run that replaced itself with work
-- under another key or a plain task (finish.lua records it `replaced` and
-- leaves its followers parked) is settled by its replacement's ending, which
-- carries the run's id (relay.py); that ending may come before the run's own
-- is recorded, and then finish.lua releases later followers with it. A run
-- with no follower whose record has passed to another run records nothing.
-- An outcome settled for the run before (lib's record_outcome) stands: the
-- followers are released with it; only one that waits for the replacement
-- (`replaced`, or `lost` held back while the run was replacing itself) gives way.
--
-- Returns the number of followers released.

local member, run, result, unkept = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local prefix, ttl_ms, state = ARGV[5], tonumber(ARGV[6]), ARGV[7] or 'succeeded'
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('HGET', KEY.record(prefix, member), 'task_id') ~= run then
  return 0
end
record_outcome(prefix, member, run, state, unkept, result, ttl_ms)
return release_followers(prefix, member, run)
