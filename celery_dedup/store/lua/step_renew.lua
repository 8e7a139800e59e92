-- step_renew: keep the steps of every delivery of this worker process that
-- executes steps: the step lock it holds (if it is inside a step), its run's
-- steps hash and its key's; one call for all of them (worker/steps.py's StepLease).
--
-- KEYS[4i-3] lock: lease i's execution lock
-- KEYS[4i-2] record: its member's status record
-- KEYS[4i-1] steps: its key's steps ("k:<step>")
-- KEYS[4i]   run_steps: its run's steps ("s:<step>")
-- ARGV[1]    lock_ms: lock TTL (the step lock's too)
-- ARGV[2]    record_ms: record TTL
-- ARGV[3..]  leases: two per lease, in order: its token, and the field of
--            the step it executes ("" between steps)
--
-- A lease whose token no longer holds the execution lock is lost, and so is
-- one whose step is `running` under another token (taken over): its step lock
-- is not extended, so the step is in doubt once its deadline passes. A lease that is kept has its step lock extended
-- to lock_ms from now and both its steps hashes kept (lib's keep_steps; one
-- that does not exist stays so).
--
-- Returns the 1-based numbers of the leases that are lost.

local now = now_ms()
local lost = {}
for i = 1, #KEYS / 4 do
  local lock, record, steps, run_steps = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local token, field = leases[2 * i - 1], leases[2 * i]
  local kept = redis.call('GET', lock) == token
  if kept and field ~= '' then
    local hash = string.sub(field, 1, 2) == 's:' and run_steps or steps
    local stored = redis.call('HGET', hash, field)
    local entry = stored and cjson.decode(stored) or {}
    if entry.state == 'running' and entry.token == token then
      entry['until'] = now + lock_ms
      redis.call('HSET', hash, field, cjson.encode(entry))
    elseif entry.state == 'running' then
      kept = false  -- taken over (an entry no longer running has ended: the body may not have said so yet)
    end
  end
  if kept then
    keep_steps(steps, record, now, lock_ms, record_ms)
    keep_steps(run_steps, record, now, lock_ms, record_ms)
  else
    lost[#lost + 1] = i
  end
end
return lost
