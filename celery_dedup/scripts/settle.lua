-- settle: hand a succeeded run's return value to its followers and release them.
--
-- KEYS[1]  the member's followers (HASH, P:fol:M; see keys.py)
-- ARGV[1]  member
-- ARGV[2]  task id of the run (it succeeded: finish.lua recorded it)
-- ARGV[3]  its return value (gate.result_payload), or "" with ARGV[4]
-- ARGV[4]  why the value could not be kept ("" when ARGV[3] is given):
--          followers then fail with it
-- ARGV[5]  key prefix
-- ARGV[6]  how long the outcome is kept for followers still to come, ms
--
-- finish.lua asks for this (wants_result) when a run succeeded and has
-- followers; between the two calls nothing can resolve them, as their
-- messages are only pushed here.
--
-- Returns the number of followers released.

local member, run, result, unkept = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local prefix, ttl_ms = ARGV[5], tonumber(ARGV[6])
record_outcome(prefix, member, run, 'succeeded', unkept, result, ttl_ms)
return release_followers(prefix, member, run)
