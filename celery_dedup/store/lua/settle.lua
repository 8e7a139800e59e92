-- settle: hand how a run ended to its followers and release them.
--
-- KEYS[1]  followers: the member's followers (HASH, P:fol:M; see keys.py)
-- ARGV[1]  member
-- ARGV[2]  run: task id of the run
-- ARGV[3]  result: its return value (gate.result_payload), or "" with unkept
-- ARGV[4]  unkept: why the value could not be kept, or the error it ended with
--          ("" when result is given): followers then fail with it
-- ARGV[5]  prefix: key prefix
-- ARGV[6]  ttl_ms: how long the outcome is kept for followers still to come
-- ARGV[7]  state: how the run ended, "succeeded" or another state of lib's ENDED
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

if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('HGET', KEY.record(prefix, member), 'task_id') ~= run then
  return 0
end
record_outcome(prefix, member, run, state, unkept, result, ttl_ms)
return release_followers(prefix, member, run)
