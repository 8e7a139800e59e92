-- step_end: record how step `field` of a run ended, if this delivery still
-- holds its lock; one round trip.
--
-- KEYS[1]  lock: the member's execution lock
-- KEYS[2]  record: the member's status record (its history gets the step's entry)
-- KEYS[3]  steps: the key's steps (HASH, "k:<step>", see store/schema.py's STEP_FIELDS)
-- KEYS[4]  run_steps: the run's steps (HASH, "s:<step>")
-- ARGV[1]  run: the run's task id
-- ARGV[2]  token: the delivery's lock token (the step lock's owner)
-- ARGV[3]  field: "s:<step>" or "k:<step>"
-- ARGV[4]  name: the step's name, for the history
-- ARGV[5]  outcome: "done" (the function returned `result`) or "failed" (it
--          raised, or its result could not be kept: `err` says why)
-- ARGV[6]  result: the return value as worker/steps.py serialized it ("" when failed)
-- ARGV[7]  err: why it failed ("" when done)
-- ARGV[8]  lock_ms: the execution lock's TTL
-- ARGV[9]  record_ms: record TTL
-- ARGV[10] history_len: history length
--
-- The step is recorded only while its entry names this token: a delivery
-- that took the step over (it found the step in doubt once this token's lock
-- ran out) executes it itself, and this ending would contradict it. While no
-- one took it over, the ending stands even if the lock ran out: nobody else
-- could have begun the step (step_begin.lua changes its token first). A
-- failed step is executed again by the next delivery that reaches it.
--
-- Returns {recorded, lock_kept}: recorded 1 when the ending was recorded;
-- lock_kept 1 when this token still holds the execution lock.

local lock, record = KEYS[1], KEYS[2]
local steps = string.sub(field, 1, 2) == 's:' and KEYS[4] or KEYS[3]

local lock_kept = redis.call('GET', lock) == token and 1 or 0
local stored = redis.call('HGET', steps, field)
if not stored then
  return {0, lock_kept}
end
local entry = cjson.decode(stored)
if entry.state ~= 'running' or entry.token ~= token then
  return {0, lock_kept}
end

local now = now_ms()
entry.token, entry['until'] = nil, nil
entry.finished_at = now
if outcome == 'done' then
  entry.state, entry.result, entry.error = 'done', result, nil
else
  entry.state, entry.result, entry.error = 'failed', nil, err
end
redis.call('HSET', steps, field, cjson.encode(entry))
step_history(record, run, name .. ' ' .. entry.state, now, history_len)
keep_steps(steps, record, now, lock_ms, record_ms)
return {1, lock_kept}
