-- start: the delivery guard. Decide whether this delivery may run its body and,
-- if so, take the execution lock and mark the record started; one round trip.
--
-- KEYS[1]  held: held set
-- KEYS[2]  record: the member's status record (HASH)
-- KEYS[3]  lock: the member's execution lock (STRING holding the owner token)
-- ARGV[1]  member
-- ARGV[2]  task_id: task id of this delivery
-- ARGV[3]  token: lock token (unique per delivery)
-- ARGV[4]  lock_ms: lock TTL
-- ARGV[5]  gated: "1" if the key was gated at enqueue (the record names its owner run)
-- ARGV[6]  key_mode: what happens to the key now, "release" (until_executing), "window"
--          (until_expired: keep the enqueue deadline if it is later), or
--          "lock" (held as long as the lock lives: a crashed run frees it
--          within one lock TTL)
-- ARGV[7]  hostname: worker hostname
-- ARGV[8]  pid: worker pid
-- ARGV[9]  retries: retries of this delivery (request.retries; 0 is not written)
-- ARGV[10] prefix: key prefix
-- ARGV[11] history_len: history length
-- ARGV[12] record_ms: record TTL: the record outlives the lock (or the hold) by this much
-- ARGV[13] want_payload: "1" to return the record's payload (a debounced run
--          takes the arguments its burst left there)
-- ARGV[14] on_locked: the task's dedup_on_locked ("skip" or "reschedule"):
--          whether a refusal for another run's lock is counted skipped or deferred
-- ARGV[15] keep_payload: "0" to delete the record's payload once this delivery
--          runs (dedup_record_args off: it was kept only to run with); "1" kept
-- ARGV[16] main: the token of the main process of the worker that delivered
--          this delivery (recovery.py judges the run by it), "" if unknown
-- ARGV[17] tag: this delivery's tag, "" where recovery could not put its
--          message back (acknowledged before the body runs, or the store is
--          not the broker)
-- ARGV[18] unacked: kombu's unacked hash, where that message waits unacknowledged
--          tag and unacked are recorded (`tag`, `unacked`) unless the
--          gate recorded where it pushed the run's message (`queue`): so
--          recovery.py finds the message of a run the gate did not route
--
-- Returns {code, detail[, payload]}:
--   {1, attempts, payload}  run: lock taken, record says started (attempts
--                   counts starts); payload "" unless asked for and present
--   {0, pttl, holder} locked by another delivery of this same run (a
--                   redelivered copy); detail: the lock's remaining ms; holder:
--                   the lock's token (its owner may be provably dead: see
--                   takeover.lua)
--   {2, state}      done: this run already ended (a state in lib's ENDED; "ended"
--                   when the record has passed to another run since)
--   {3, owner}      superseded: the key belongs to another run now
--   {4, pttl, holder} locked by another run (while_executing, until_executing)
--   {5, run, outcome} a follower's delivery (gate.lua parked it, lib's
--                   release_followers pushed it): it resolves as run `run`
--                   ended; outcome is the JSON lib's record_outcome wrote, ""
--                   if none was (nothing else changes)
-- Every refusal increments the record's `skipped` counter, and the task's
-- `skipped` or `deferred` decision counter (see lib's count).

local held, record, lock = KEYS[1], KEYS[2], KEYS[3]

local followers = KEY.followers(prefix, member)
local parked = redis.call('HGET', followers, task_id)
if parked then
  local ok, follower = pcall(cjson.decode, parked)
  if ok and follower.run and not follower.message then
    redis.call('HDEL', followers, task_id)
    return {5, follower.run, redis.call('HGET', KEY.outcomes(prefix, member), follower.run) or ''}
  end
end

local now = now_ms()
local current = redis.call('HMGET', record, 'task_id', 'state', 'held_until', 'ended', 'hold_ms', 'queued_at', 'payload',
  'queue', 'hn')
local owner, state = current[1], current[2]

if owner == task_id and ENDED[state] then
  redis.call('HINCRBY', record, 'skipped', 1)
  count(prefix, member, 'skipped')
  return {2, state}
end
if owner ~= task_id and current[4] and has_ended(prefix, member, current[4], task_id) then
  -- A run that ended before the record passed to another (see lib's REMEMBERED).
  redis.call('HINCRBY', record, 'skipped', 1)
  count(prefix, member, 'skipped')
  return {2, 'ended'}
end
if gated and owner and owner ~= task_id then
  redis.call('HINCRBY', record, 'skipped', 1)
  count(prefix, member, 'skipped')
  return {3, owner}
end
local holder = redis.call('GET', lock)
if holder then
  if owner then
    redis.call('HINCRBY', record, 'skipped', 1)
  end
  local same = owner == task_id and redis.call('HGET', record, 'lock') == holder
  count(prefix, member, (same or on_locked == 'reschedule') and 'deferred' or 'skipped')
  return {same and 0 or 4, redis.call('PTTL', lock), holder}
end

redis.call('SET', lock, token, 'PX', lock_ms)
-- What this run's record holds already (a record this script starts holds none of it).
local held_until, hold_ms, queued_at, payload, routed = 0, false, false, '', false
-- The record's history count and queued_at (lib's transition), while no entry was written since they were read.
local base = nil
if owner == task_id then
  held_until, hold_ms, queued_at, payload = tonumber(current[3] or 0), current[5], current[6], current[7] or ''
  routed = current[8] ~= false
  base = {tonumber(current[9] or 0), tonumber(queued_at)}
end
if owner == task_id and state == 'started' then
  -- Started before, lock gone, never finished: that delivery's worker died.
  transition(prefix, record, member, 'lost', now, 'lock expired', history_len, state, nil, base)
  state = 'lost'
  base = nil
end
if owner ~= task_id then
  -- No record for this run (ungated, or the record expired or passed on): start one, queued now.
  local fields, hn = retire(prefix, record, member, now, history_len, state, owner, task_id, record_ms)
  redis.call('HSET', record, 'task_id', task_id, 'queued_at', now, unpack(fields))
  state = false
  base = {hn, now}
end
local attempts = redis.call('HINCRBY', record, 'attempts', 1)
if keep_payload then
  redis.call('HDEL', record, 'finished_at', 'lock_lost_at', 'window_until', 'missing_since', 'hold_ms')
else
  redis.call('HDEL', record, 'finished_at', 'lock_lost_at', 'window_until', 'missing_since', 'hold_ms', 'payload')
end
local fields = {'started_at', now, 'worker', hostname, 'pid', pid, 'lock', token}
if retries > 0 then
  fields[#fields + 1], fields[#fields + 2] = 'retries', retries
end
if main ~= '' then
  fields[#fields + 1], fields[#fields + 2] = 'main', main
else
  redis.call('HDEL', record, 'main')  -- an earlier delivery's worker does not answer for this one
end
if routed then
  -- The gate's `tag` and `unacked` name the message it pushed (the reaper's too): kept.
elseif tag ~= '' and unacked ~= '' then
  fields[#fields + 1], fields[#fields + 2], fields[#fields + 3], fields[#fields + 4] = 'tag', tag, 'unacked', unacked
else
  redis.call('HDEL', record, 'tag', 'unacked')  -- an earlier delivery's message, not this one's
end
if hold_ms then
  -- Two-phase gate: the message is out (here it is) though its confirm has not come (or never
  -- will): the key gets the hold the confirm would have given it.
  held_until = math.max(held_until, tonumber(queued_at or now) + tonumber(hold_ms))
  redis.call('SADD', held, member)  -- the reaper may have let it go when the lease ended
end
if key_mode == 'release' then
  redis.call('SREM', held, member)
  held_until = 0
elseif held_until > 0 and (key_mode == 'lock' or held_until < now + lock_ms) then
  if key_mode == 'window' then
    fields[#fields + 1], fields[#fields + 2] = 'window_until', held_until  -- finish.lua returns to it
  end
  held_until = now + lock_ms  -- renewals extend it while the run lives
end
fields[#fields + 1], fields[#fields + 2] = 'held_until', held_until
local note = ''
if attempts > 1 then
  note = 'attempt ' .. attempts
end
transition(prefix, record, member, 'started', now, note, history_len, state, fields, base)
expire_record(record, math.max(held_until - now, lock_ms) + record_ms)
if not want_payload then
  payload = ''
end
return {1, attempts, payload}
