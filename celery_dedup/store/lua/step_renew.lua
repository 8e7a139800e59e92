-- step_renew: keep the steps of every delivery of this worker process that
-- executes steps: the step lock it holds (if it is inside a step) and its
-- member's steps hash; one call for all of them (worker/steps.py's StepLease).
--
-- KEYS[3i-2] lock: lease i's execution lock
-- KEYS[3i-1] record: its member's status record
-- KEYS[3i]   steps: its member's steps
-- ARGV[1]    lock_ms: lock TTL (the step lock's too)
-- ARGV[2]    record_ms: record TTL
-- ARGV[3..]  leases: two per lease, in order: its token, and the field of
--            the step it executes ("" between steps)
--
-- A lease whose token no longer holds the execution lock is lost, and so is
-- one whose step is `running` under another token (taken over): its step lock
-- is not extended, so the step is in doubt once its deadline passes. A lease that is kept has its step lock extended
-- to lock_ms from now and its steps kept (lib's keep_steps).
--
-- Returns the 1-based numbers of the leases that are lost.

local now = now_ms()
local lost = {}
for i = 1, #KEYS / 3 do
  local lock, record, steps = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local token, field = leases[2 * i - 1], leases[2 * i]
  local kept = redis.call('GET', lock) == token
  if kept and field ~= '' then
    local stored = redis.call('HGET', steps, field)
    local entry = stored and cjson.decode(stored) or {}
    if entry.state == 'running' and entry.token == token then
      entry['until'] = now + lock_ms
      redis.call('HSET', steps, field, cjson.encode(entry))
    elseif entry.state == 'running' then
      kept = false  -- taken over (an entry no longer running has ended: the body may not have said so yet)
    end
  end
  if kept then
    keep_steps(steps, record, now, lock_ms, record_ms)
  else
    lost[#lost + 1] = i
  end
end
return lost
