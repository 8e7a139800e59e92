-- finish: record how a run ended, release its execution lock, and drop its key;
-- each only where this run owns it (compare-and-delete by task id and token).
--
-- KEYS[1]  held set
-- KEYS[2]  the member's status record (HASH)
-- KEYS[3]  the member's execution lock
-- ARGV[1]  member
-- ARGV[2]  task id of the run
-- ARGV[3]  state to record (succeeded, failed, retry, revoked, lost, ...)
-- ARGV[4]  "1" to drop the key now, "0" to keep it held until its deadline
--          (an idempotency window, or a retry that keeps its key); a window
--          the run's lock outlived (start.lua's window_until) ends on time
-- ARGV[5]  record TTL after the ending, ms; "0" deletes the record outright (its
--          message was never enqueued)
-- ARGV[6]  the run's lock token; "" if it holds none; "*" for whatever lock the
--          record says this run holds (its worker is known to be dead)
-- ARGV[7]  key prefix
-- ARGV[8]  history length
-- ARGV[9]  error summary, "" for none
-- ARGV[10] the run's payload (gate.call_payload), "" for none: kept so an
--          operator can re-enqueue a run that ended without success
--
-- Returns {owned, lock_kept}: owned is 1 if the record names this run (else
-- nothing but the lock is touched); lock_kept is 0 if the run held a token but
-- the lock was no longer its own (expired or taken over; recorded as
-- lock_lost_at), 1 otherwise. A run that has already ended is left as it is.

local held, record, lock = KEYS[1], KEYS[2], KEYS[3]
local member, task_id, state = ARGV[1], ARGV[2], ARGV[3]
local drop, record_ms, token = ARGV[4] == '1', tonumber(ARGV[5]), ARGV[6]
local prefix, history_len, err, payload = ARGV[7], tonumber(ARGV[8]), ARGV[9], ARGV[10] or ''

local current = redis.call('HMGET', record, 'task_id', 'lock')
if token == '*' then
  token = current[1] == task_id and current[2] or ''
end
local lock_kept = 1
if token ~= '' then
  if redis.call('GET', lock) == token then
    redis.call('DEL', lock)
  else
    lock_kept = 0
    count(prefix, member, 'lock_lost')
  end
end
if current[1] ~= task_id then
  return {0, lock_kept}
end
if token ~= '' and current[2] and current[2] ~= token then
  -- Another delivery of this run took over (after this one lost its lock):
  -- the record is that delivery's to finish.
  return {1, lock_kept}
end
-- (Not after `lost`: a run declared lost may still finish, and then how it
-- really ended is recorded.)
if ENDED[redis.call('HGET', record, 'state')] and not (drop and record_ms == 0) then
  -- The run has ended already; a later report (a worker-side signal after
  -- the body settled it) must not rewrite how it ended.
  return {1, lock_kept}
end
if drop and record_ms == 0 then
  redis.call('SREM', held, member)
  forget(prefix, record, member)
  count(prefix, member, 'accepted', -1)  -- its publish failed: it was never accepted after all
  return {1, lock_kept}
end

local now = now_ms()
if state ~= 'retry' then
  redis.call('HSET', record, 'finished_at', now)
end
if err ~= '' then
  redis.call('HSET', record, 'error', err)
end
if payload ~= '' then
  redis.call('HSET', record, 'payload', payload)
end
if lock_kept == 0 then
  redis.call('HSETNX', record, 'lock_lost_at', now)
end
if token ~= '' then
  redis.call('HDEL', record, 'lock')
end
transition(prefix, record, member, state, now, task_id, lock_kept == 0 and 'lock lost' or '', history_len)
if drop then
  redis.call('SREM', held, member)
  redis.call('HSET', record, 'held_until', 0)
  expire_record(prefix, record, member, record_ms)
else
  local held_until = tonumber(redis.call('HGET', record, 'held_until') or 0)
  local window_until = redis.call('HGET', record, 'window_until')
  if window_until and state ~= 'retry' then
    held_until = tonumber(window_until)
    redis.call('HDEL', record, 'window_until')
    if held_until <= now then
      redis.call('SREM', held, member)
      held_until = 0
    end
    redis.call('HSET', record, 'held_until', held_until)
  end
  expire_record(prefix, record, member, math.max(held_until - now, 0) + record_ms)
end
return {1, lock_kept}
