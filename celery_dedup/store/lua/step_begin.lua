-- step_begin: may this delivery execute step `field` of its run? If so it now
-- holds the step's lock (worker/steps.py); one round trip.
--
-- KEYS[1]  lock: the member's execution lock
-- KEYS[2]  record: the member's status record (its history gets the step's entries)
-- KEYS[3]  steps: the key's steps (HASH, "k:<step>", see store/schema.py's STEP_FIELDS)
-- KEYS[4]  run_steps: the run's steps (HASH, "s:<step>")
-- ARGV[1]  run: the run's task id
-- ARGV[2]  token: the delivery's lock token, which owns the step's lock too
-- ARGV[3]  field: "s:<step>" (the run's step) or "k:<step>" (the key's)
-- ARGV[4]  name: the step's name, for the history
-- ARGV[5]  lock_ms: the step lock's TTL (the execution lock's)
-- ARGV[6]  record_ms: record TTL (how long a record outlives its hold)
-- ARGV[7]  history_len: history length
-- ARGV[8]  on_doubt: "retry" (a step in doubt is taken and executed again)
--          or "raise" (it is marked `doubt` and left to an operator)
-- ARGV[9]  dead: the token of a step lock whose owner is provably dead (its
--          lock is taken although its deadline has not passed), "" for none
--
-- Only the delivery that holds the execution lock begins a step: a delivery
-- that lost it (paused past its TTL, taken over) begins none. Each run keeps
-- its steps in a hash of its own: a later run of the key drops none of them,
-- so a copy of the run delivered after a later run took steps still finds
-- its steps done. A key's steps hash written before runs had their own holds
-- one run's steps (its `run` field names it): that run's first step here
-- moves them into the run's hash. A step lock is the entry's `token` and `until` (ms, server
-- clock), renewed by step_renew.lua while its executor lives; a `running`
-- entry past `until`, or whose owner is dead, is in doubt: its executor died
-- (or lost its lock) inside the step.
--
-- A `running` entry of this very token is this delivery's own begin, asked
-- again because its reply was lost (a delivery calls each step once, and the
-- function only after its begin answered): it is granted again, its attempt
-- and history unchanged, not waited for as another delivery's lock.
--
-- Returns {code, detail, extra}:
--   {1, attempts}         run: execute the step (its lock is this token's now)
--   {2, attempts}         in doubt, run again (on_doubt "retry"), same as 1
--   {3, result}           done: its stored result
--   {4, attempts}         in doubt, not run (on_doubt "raise"): the entry says `doubt`
--   {5, pttl, holder}     busy: another delivery's live step lock (holder's)
--   {0}                   this token does not hold the execution lock

local lock, record = KEYS[1], KEYS[2]
local steps = KEYS[3]

if redis.call('GET', lock) ~= token then
  return {0}
end
local now = now_ms()

if string.sub(field, 1, 2) == 's:' then
  local legacy = steps
  steps = KEYS[4]
  if redis.call('EXISTS', steps) == 0 and redis.call('HGET', legacy, 'run') == run then
    local moved = {}
    for _, other in ipairs(redis.call('HKEYS', legacy)) do
      if string.sub(other, 1, 2) == 's:' then
        moved[#moved + 1] = other
      end
    end
    if #moved > 0 then
      local values = redis.call('HMGET', legacy, unpack(moved))
      local fields = {}
      for i, other in ipairs(moved) do
        fields[#fields + 1], fields[#fields + 2] = other, values[i]
      end
      redis.call('HSET', steps, unpack(fields))
      local ttl = redis.call('PTTL', legacy)
      if ttl > 0 then
        redis.call('PEXPIRE', steps, ttl)
      end
      redis.call('HDEL', legacy, unpack(moved))
    end
    redis.call('HDEL', legacy, 'run')
  end
end

local entry = {}
local stored = redis.call('HGET', steps, field)
if stored then
  entry = cjson.decode(stored)
end
local doubt = false
if entry.state == 'done' then
  keep_steps(steps, record, now, lock_ms, record_ms)
  return {3, entry.result or ''}
elseif entry.state == 'running' then
  if entry.token == token then
    entry['until'] = now + lock_ms
    redis.call('HSET', steps, field, cjson.encode(entry))
    keep_steps(steps, record, now, lock_ms, record_ms)
    return {1, tonumber(entry.attempts or 1)}
  end
  if entry.token ~= dead and tonumber(entry['until']) > now then
    return {5, tonumber(entry['until']) - now, entry.token}
  end
  doubt = true
elseif entry.state == 'doubt' then
  doubt = true
end
local attempts = tonumber(entry.attempts or 0)

if doubt and on_doubt == 'raise' then
  if entry.state ~= 'doubt' then
    entry.state, entry.token, entry['until'] = 'doubt', nil, nil
    redis.call('HSET', steps, field, cjson.encode(entry))
    step_history(record, run, name .. ' in doubt', now, history_len)
  end
  keep_steps(steps, record, now, lock_ms, record_ms)
  return {4, attempts}
end

entry.state, entry.token, entry['until'] = 'running', token, now + lock_ms
entry.attempts, entry.error = attempts + 1, nil
entry.started_at = entry.started_at or now
redis.call('HSET', steps, field, cjson.encode(entry))
local note = name .. ' started'
if doubt then
  note = name .. ' in doubt, again'
elseif attempts > 0 then
  note = name .. ' again'
end
step_history(record, run, note, now, history_len)
keep_steps(steps, record, now, lock_ms, record_ms)
return {doubt and 2 or 1, attempts + 1}
