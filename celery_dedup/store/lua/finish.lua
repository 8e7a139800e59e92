-- finish: record how a run ended, release its execution lock, and drop its key;
-- each only where the caller may.
--
-- KEYS[1]  held: held set
-- KEYS[2]  record: the member's status record (HASH)
-- KEYS[3]  lock: the member's execution lock
-- KEYS[4]  result_key: optional, the run's result key in Celery's Redis result
--          backend on this server, written (SET, or SETEX with result_expires)
--          and published with result_value after the ending is recorded,
--          whatever this returns: a caller who sees the result and calls again
--          finds the key released
-- ARGV[1]  member
-- ARGV[2]  task_id: task id of the run
-- ARGV[3]  state: state to record (succeeded, failed, retry, queued, revoked, lost, ...)
-- ARGV[4]  drop: "1" to drop the key now, "0" to keep it held until its deadline
--          (an idempotency window, or a run that goes on: a retry, a
--          replacement); a window the run's lock outlived (start.lua's
--          window_until) ends on time
-- ARGV[5]  record_ms: record TTL after the ending; "0" deletes the record outright (its
--          message was never enqueued), unless the run has begun
-- ARGV[6]  token: a lock token the caller may release: the running delivery's own, or
--          (reports) that of a delivery whose process is known to be gone; ""
--          for none. A lock is only ever deleted by its token.
-- ARGV[7]  prefix: key prefix
-- ARGV[8]  history_len: history length
-- ARGV[9]  err: error summary, "" for none
-- ARGV[10] payload: the run's payload (gate.call_payload), "" for none: kept so
--          an operator can re-enqueue a run that ended without success
-- ARGV[11] role: who calls, "run" the delivery that ran the body (a lock it no
--          longer holds is a lost lock: counted and recorded); "report" an
--          ending reported from outside the body (a worker's main process, a
--          signal, a refused delivery): a run whose live lock the caller does
--          not own is left to the delivery holding it; "stop" a report of a
--          delivery that is being stopped (terminate, hard time limit): the
--          ending is recorded now, but its lock and key stay until that
--          delivery finishes or its lock expires
-- ARGV[12] note: a history note for the transition, "" for none
-- ARGV[13] result: the run's return value (gate.result_payload), "" for none:
--          kept for its followers (see lib's settle_followers)
-- ARGV[14] result_value: with result_key, the result as the backend encodes it
--          ("" without)
-- ARGV[15] result_expires: with result_key, its expiry, seconds; "0" for none
--
-- Nothing but a lock named by token is touched unless the record names this
-- run (then, or for a body's final ending when no record is left at all, only
-- its memory of ended runs, see lib's REMEMBERED, and its followers). A run
-- that has ended is never recorded again (a report that comes after the body
-- settled it changes nothing); the delivery that still held its lock then
-- only releases that lock and, with drop, its key. A body whose lock was
-- taken over by another delivery of its run and that still ends ("run", a
-- final state) records the run's ending: that delivery keeps the lock and the
-- key until it is through, as after a "stop".
--
-- A final ending (not retry or queued) settles the run's followers: their
-- parked messages are pushed, to resolve as the run ended. Retry or queued
-- (a replacement under the run's key goes on as the run) takes away the
-- record's `replacing` mark (replacing.lua).
--
-- Returns {owned, lock_kept, wants_result}: owned is 1 if the record names
-- this run; lock_kept is 0 if a "run" caller's token no longer held the lock
-- (expired or taken over; recorded as lock_lost_at), 1 otherwise;
-- wants_result is 1 when the run succeeded, has followers and result was
-- "": the caller settles them with the return value (settle.lua).

local held, record, lock, result_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]

-- Every return goes through here: the backend's result (result_key) follows the ending.
local function reply(values)
  if result_key then
    if result_expires > 0 then
      redis.call('SETEX', result_key, result_expires, result_value)
    else
      redis.call('SET', result_key, result_value)
    end
    redis.call('PUBLISH', result_key, result_value)
  end
  return values
end

local current = redis.call('HMGET', record, 'task_id', 'lock', 'state', 'hn', 'queued_at')
local lock_kept, released = 1, false
if token ~= '' then
  if redis.call('GET', lock) == token then
    redis.call('DEL', lock)
    released = true
  elseif role == 'run' then
    lock_kept = 0
    count(prefix, member, 'lock_lost')
  end
end
local final = state ~= 'retry' and state ~= 'queued' and state ~= ''
if current[1] ~= task_id then
  if final and (current[1] or (role == 'run' and record_ms > 0)) then
    -- The record passed to another run meanwhile (while_executing, a key
    -- released at start, a run declared lost), or is gone (an operator's
    -- purge, a server that lost its data) while this body ran: it remembers
    -- that this one ended, so a late copy of it is skipped (start.lua).
    local keep_ms = math.max(record_ms, redis.call('PTTL', record))
    local ended = remember_ended(prefix, member, task_id, redis.call('HGET', record, 'ended'), now_ms(), keep_ms)
    redis.call('HSET', record, 'ended', ended)
    if not current[1] and redis.call('HLEN', record) == 1 then
      redis.call('PEXPIRE', record, keep_ms)  -- a record of nothing but that memory
    end
  end
  -- Only this run's followers are still this call's to settle.
  local wants = final and settle_followers(prefix, member, task_id, state, err, result, record_ms)
  return reply({0, lock_kept, wants and 1 or 0})
end
local run_lock = current[2]
-- Another delivery of this run took over after this one lost its lock.
local overtaken = token ~= '' and run_lock and run_lock ~= token
if overtaken and not (role == 'run' and final) then
  return reply({1, lock_kept, 0})  -- the record is that delivery's to finish
end
-- A delivery the caller does not speak for still runs this run. A body that
-- ended beside it (overtaken) ended the run all the same: its ending is recorded
-- now, as a stop's is, and the lock and key stay until that delivery is through.
local running = (token == '' or overtaken) and run_lock and redis.call('GET', lock) == run_lock
if running and role ~= 'stop' and not overtaken then
  return reply({1, lock_kept, 0})
end
if drop and record_ms == 0 then
  if current[3] ~= 'queued' and current[3] ~= 'pending' and current[3] ~= 'publishing' then
    return reply({1, lock_kept, 0})  -- the run began (eager mode runs it inside its publish): its ending stands
  end
  redis.call('SREM', held, member)
  forget(prefix, record, member)
  count(prefix, member, 'accepted', -1)  -- its publish failed: it was never accepted after all
  return reply({1, lock_kept, 0})
end

local now = now_ms()

-- Drop the key, or hold it to its deadline (a window ends on time). `cleared`: the
-- caller has set held_until to 0 already.
local function settle_key(cleared)
  if drop then
    redis.call('SREM', held, member)
    if not cleared then
      redis.call('HSET', record, 'held_until', 0)
    end
    expire_record(record, record_ms)
    return
  end
  local held_until = tonumber(redis.call('HGET', record, 'held_until') or 0)
  local window_until = redis.call('HGET', record, 'window_until')
  if window_until and state ~= 'retry' and state ~= 'queued' then
    held_until = tonumber(window_until)
    redis.call('HDEL', record, 'window_until')
    if held_until <= now then
      redis.call('SREM', held, member)
      held_until = 0
    end
    redis.call('HSET', record, 'held_until', held_until)
  end
  expire_record(record, math.max(held_until - now, 0) + record_ms)
end

-- (Not after `lost`: a run declared lost may still finish, and then how it
-- really ended is recorded.)
if ENDED[current[3]] then
  -- The delivery that held the run's lock is through after an earlier report
  -- recorded the ending (a terminate it survived, or outlived): its lock was
  -- released here or, for a report, ran out before its exit was acted on.
  if released or (role ~= 'run' and run_lock and redis.call('GET', lock) ~= run_lock) then
    redis.call('HDEL', record, 'lock')
    settle_key()
  end
  return reply({1, lock_kept, 0})
end

-- An ending that goes on (a retry, a replacement under the key) of a run whose next publish is out already:
-- the record is that publish's (queued, or parked again: a new record when the key had passed on or the
-- server lost its data, which dispatch pushes only while pending), or says so already (this report sent
-- again after its reply was lost). Its lock goes back; the record stays as it is.
if not final and (current[3] == state or current[3] == 'queued' or current[3] == 'pending'
    or current[3] == 'publishing') then
  if not running then
    redis.call('HDEL', record, 'lock')
  end
  return reply({1, lock_kept, 0})
end

local fields = {}
if state ~= 'retry' and state ~= 'queued' then
  fields[#fields + 1], fields[#fields + 2] = 'finished_at', now
end
if err ~= '' then
  fields[#fields + 1], fields[#fields + 2] = 'error', err
end
if payload ~= '' then
  fields[#fields + 1], fields[#fields + 2] = 'payload', payload
end
if drop and not running then
  fields[#fields + 1], fields[#fields + 2] = 'held_until', 0  -- settle_key drops the key below
end
if lock_kept == 0 then
  redis.call('HSETNX', record, 'lock_lost_at', now)
  note = note == '' and 'lock lost' or note .. '; lock lost'
end
if not running then
  -- The run's lock was released above, or is gone already (it expired before
  -- this report came): the record names it no more.
  redis.call('HDEL', record, 'lock')
end
if not final then
  -- A replacement under the run's key goes on as the run: not a replacement to wait for (replacing.lua).
  redis.call('HDEL', record, 'replacing')
end
if ENDED[state] then
  -- A final ending: what only an unended run needs goes; with the key, so does what duplicates are compared with.
  if drop and not running then
    redis.call('HDEL', record, 'args_fp', unpack(UNENDED_ONLY))
  else
    redis.call('HDEL', record, unpack(UNENDED_ONLY))
  end
end
transition(prefix, record, member, state, now, note, history_len, current[3], fields,
  {tonumber(current[4] or 0), tonumber(current[5])})
local wants_result = 0
if final and settle_followers(prefix, member, task_id, state, err, result, record_ms) then
  wants_result = 1
end
if running then
  -- Stopping: the lock's renewals keep the key held while the delivery lives.
  local held_until = tonumber(redis.call('HGET', record, 'held_until') or 0)
  expire_record(record, math.max(held_until - now, 0) + record_ms)
else
  settle_key(true)
end
return reply({1, lock_kept, wants_result})
