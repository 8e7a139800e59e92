-- gate: hold a business key and enqueue its message, or do neither.
--
-- KEYS[1]   held: held set (SET of members whose key is held)
-- KEYS[2]   record: the member's status record (HASH)
-- KEYS[3]   queue: optional, the kombu queue list to LPUSH the message onto
-- KEYS[4..] expire: optional, queue lists to PEXPIRE (queues declared with x-expires)
-- ARGV[1]   member: escaped task name ":" business key
-- ARGV[2]   task_id: task id of this run
-- ARGV[3]   nonce: publish nonce (repeated by kombu's publish retries only)
-- ARGV[4]   hold_ms: how long the key stays held if the run never finishes
-- ARGV[5]   grace_ms: record grace: a continuation's record outlives the hold
--           by this much (a new record gets no expiry, see below)
-- ARGV[6]   prefix: key prefix (for the indexes, see lib)
-- ARGV[7]   history_len: history length
-- ARGV[8]   argsrepr: "" to record none
-- ARGV[9]   kwargsrepr: "" to record none
-- ARGV[10]  continuation: "1" if this publish continues its run (Task.retry, a
--           replacement under the same key); "2" for a deferred copy of a run
--           (it continues the run but does not hold again a key freed as the
--           run started: calls made while the body runs are new runs; a copy
--           of a run the record no longer names pushes nothing); "0" for a
--           call
-- ARGV[11]  max_followers: followers a run may carry ("0": this call has
--           nothing to continue, so as a duplicate it is only answered, see
--           "Followers" below)
-- ARGV[12]  lease_ms: publish lease of the two-phase gate (no queue: the
--           message goes to a broker apart from the store): a new run is held
--           in state `publishing` for this long, until confirm.lua gives it its
--           hold; "0" for none
-- ARGV[13]  message: with queue, the serialized kombu message
-- ARGV[14]  expires_ms: with queue, PEXPIRE ms for the expire lists, or ""
-- ARGV[15]  tag: with queue, the message's delivery tag
-- ARGV[16]  unacked: with queue, kombu's unacked hash (where a fetched message's tag goes)
-- ARGV[17]  payload: with queue, the message's payload (gate.message_payload), "" for none
-- ARGV[18]  window_ms: with queue, debounce window; "0" if the task does not debounce
-- ARGV[19]  max_wait_ms: with queue, debounce max wait
-- ARGV[20]  latest: with queue, "1" if a later call's payload replaces the pending one
-- Without a queue, ARGV[13..20] are "" (numbers "0").
-- ARGV[21]  args_fp: the call's arguments fingerprint; "" for a call that is
--           not compared (dedup_on_mismatch "ignore", debounce "latest", a
--           continuation), see "Arguments" below
-- Where the message went (queue, tag, unacked hash, pushed_at) is recorded, so
-- the reaper can tell a message the transport lost after fetching it.
--
-- A new record gets no expiry: it lives as long as its run may still run.
-- start.lua, the run's ending (finish.lua, release.lua) or the reaper (a run
-- it declares lost, or one whose hold passed and whose message is gone) gives
-- it one. So a new key costs TIME, HMGET, SADD, HSET (the record and its
-- first history entry), ZADD state index, ZADD name index, HINCRBY stats and
-- LPUSH.
--
-- A run is accepted once. The record remembers the nonces of the key's last
-- accepted publishes (`nonce`, and the previous ones in `nonces`) and its last
-- ended runs (`ended`), carried from run to run (lib's REMEMBERED): a publish
-- that kombu retries after its reply was lost pushes nothing, even when its run
-- has ended and another run holds the key since. A call naming the task id of
-- the run its record names is a duplicate of that run; only a continuation
-- (continuation) of a run that has not ended pushes again.
--
-- Debounce: a new run's message is parked in its record (state `pending`) and
-- its member put in P:due, scored by when it is due; dispatch.lua pushes it
-- then. A call (never a continuation) while the key is held joins that run: it pushes the due time
-- back (pending runs only; never past first call + max wait) and, with
-- latest, leaves its payload and argument reprs for the run to use. A retry or
-- a replacement under the key (a continuation of the run itself, not a
-- deferred copy) leaves its own: the run goes on with the arguments it was
-- given, not with its burst's again; unless a call joined since the body
-- started (`joined_at`: another continuation, e.g. of a copy of the body that
-- lost its lock, held the key again), whose arguments are newer.
--
-- Arguments: a new run keeps the call's fingerprint (`args_fp`). A duplicate,
-- a follower or a join whose fingerprint differs from it is counted
-- (`mismatched`, in the record and the stats: lib's note_mismatch); the run's
-- fingerprint goes back with the answer, for the caller to warn or raise.
--
-- Followers: a duplicate (or a debounce join) that carries something to
-- continue (max_followers > 0: its id in a group or chord, callbacks, a chain) is
-- parked in P:fol:M under its own task id, with its message and queue, as a
-- follower of the run that has the key; lib's release_followers pushes it when
-- that run ends, and start.lua resolves its delivery as the run ended. A run
-- that has ended already (its key held for a window) releases it at once.
--
-- Two-phase gate (lease_ms > 0): the caller publishes after this script and
-- then confirms the run (confirm.lua). Until then the key is held only for the
-- lease, so a publisher that dies in between frees it when the lease ends, and
-- the next call takes it over as it would any hold that has passed.
--
-- Returns {code, task id}; an answer naming the run `owner` that has the key
-- adds that run's arguments fingerprint, fp ("" if it has none):
--   {1, task_id}       accepted: key held, message pushed (or parked, debounce)
--   {0, owner, fp}     duplicate: the key is held by run `owner`, or the call
--                      names run `owner` itself; nothing written but the
--                      record's duplicate (and mismatch) counters
--   {2, task_id}       nothing pushed, as nothing is needed: this very publish
--                      was accepted before (a kombu retry), it continues a
--                      run that has already ended (a late deferred copy), or
--                      it is a deferred copy of a run whose record names
--                      another run now (it started and the key passed on)
--   {3, owner, fp}     debounce: joined the burst of run `owner`; nothing pushed
--   {4, owner}         refused: run `owner` has max_followers already; nothing written
--   {5, owner, fp}     a follower of run `owner` (a duplicate): parked
--   {5, owner, fp, 1}  a follower that joined the burst of run `owner` (as code 3): parked
-- Deadlines come from the server clock; a held member whose deadline passed, or
-- whose record is gone, is stale and taken over.

local held, record, queue = KEYS[1], KEYS[2], KEYS[3]
local continues, defers = continuation ~= '0', continuation == '2'
local debounce = queue and window_ms > 0
local due_key = KEY.due(prefix)

local now = now_ms()
local owner = redis.call('HMGET', record, 'task_id', 'nonce', 'held_until', 'state', 'nonces', 'joined_nonce', 'ended',
  'args_fp')
local owner_id, owner_nonce, owner_state, owner_nonces = owner[1], owner[2], owner[4], owner[5] or ''
local owner_fp = owner[8] or ''

local followers = KEY.followers(prefix, member)

local function room_to_follow()
  return redis.call('HEXISTS', followers, task_id) == 1 or redis.call('HLEN', followers) < max_followers
end

-- Park this call as a follower of `run` (in `run_state`); false if it already has its share.
local function park(run, run_state)
  if not room_to_follow() then
    return false
  end
  redis.call('HSET', followers, task_id, cjson.encode({run = run, queue = queue, message = message, at = now}))
  redis.call('PEXPIRE', followers, math.max(redis.call('PTTL', record), hold_ms + grace_ms))
  redis.call('SADD', KEY.following(prefix), member)
  count(prefix, member, 'followed')
  if ENDED[run_state] then
    release_followers(prefix, member, run)  -- its ending is known: resolve this one at once
  end
  return true
end

-- A duplicate of `run`; one with something to continue follows it (not a call
-- that names the run itself: it shares the run's id, so it resolves with it).
local function duplicate_of(run)
  if max_followers > 0 and queue and run ~= task_id then
    if not park(run, owner_state) then
      return {4, run}
    end
    redis.call('HINCRBY', record, 'duplicates', 1)
    note_mismatch(prefix, record, member, args_fp, owner_fp)
    return {5, run, owner_fp}
  end
  redis.call('HINCRBY', record, 'duplicates', 1)
  count(prefix, member, 'deduplicated')
  note_mismatch(prefix, record, member, args_fp, owner_fp)
  return {0, run, owner_fp}
end

if owner_nonce == nonce or remembers(owner_nonces, nonce) then
  return {2, task_id}  -- kombu retried a publish the gate accepted already
end
if owner[6] == nonce then
  return {3, owner_id, owner_fp}  -- ... or one that joined a debounced burst already
end

local same_run = owner_id == task_id
if defers and owner_id and not same_run then
  -- A deferred copy of a run its key's record no longer names: the run
  -- started and the key passed on, or it ended, or another run took over its
  -- hold (start.lua would skip it as superseded). Nothing left to run; the
  -- key's current run is neither touched nor answered for.
  return {2, task_id}
end
-- A deferred copy of a run that freed its key as it started (until_executing,
-- debounce) leaves it free: a call made while the body runs is a run of its own.
local stays_free = same_run and defers and owner_state == 'started' and tonumber(owner[3] or 0) == 0
if continues and not same_run and owner[7] and has_ended(prefix, member, owner[7], task_id) then
  return {2, task_id}  -- it continues a run that has ended since: nothing left to run
end
if same_run then
  if not continues then
    return duplicate_of(task_id)  -- a call that names a run the record knows
  end
  if ENDED[owner_state] then
    return {2, task_id}  -- nothing left to run: nothing is pushed
  end
  if not stays_free then
    redis.call('SADD', held, member)
  end
  local since = redis.call('HMGET', record, 'joined_at', 'started_at')
  local joined_since = since[1] and tonumber(since[1]) >= tonumber(since[2] or 0)
  if not defers and payload ~= '' and not joined_since then
    -- A retry or a replacement under the key runs with the arguments it was
    -- given: they become the run's newest (a deferred copy carries its
    -- message's first arguments, and leaves the burst's in place). Not over
    -- a call that joined since the body started (the key held again by an
    -- earlier continuation): that call's are newer than any this body began with.
    redis.call('HSET', record, 'payload', payload)
    if argsrepr ~= '' or kwargsrepr ~= '' then
      redis.call('HSET', record, 'args', argsrepr, 'kwargs', kwargsrepr)
    end
  end
else
  local fresh = redis.call('SADD', held, member) == 1
  if not fresh and owner_id and tonumber(owner[3] or 0) > now then
    if continues or not debounce then
      return duplicate_of(owner_id)  -- a continuation never joins a burst: its arguments predate it
    end
    if max_followers > 0 and not room_to_follow() then
      return {4, owner_id}
    end
    if owner_state == 'pending' then
      local first = tonumber(redis.call('HGET', record, 'first_at') or now)
      local due = math.min(now + window_ms, first + max_wait_ms)
      redis.call('HSET', record, 'due_at', due)
      redis.call('ZADD', due_key, due, member)
    end
    redis.call('HINCRBY', record, 'debounced', 1)
    redis.call('HSET', record, 'joined_nonce', nonce, 'joined_at', now)
    if latest then
      redis.call('HSET', record, 'payload', payload)
      if argsrepr ~= '' or kwargsrepr ~= '' then
        redis.call('HSET', record, 'args', argsrepr, 'kwargs', kwargsrepr)
      end
    end
    count(prefix, member, 'collapsed')
    note_mismatch(prefix, record, member, args_fp, owner_fp)
    if max_followers > 0 then
      park(owner_id, owner_state)
      return {5, owner_id, owner_fp, 1}
    end
    return {3, owner_id, owner_fp}
  end
end

if same_run then
  -- It keeps its state: its ending (retry) records that.
  local until_ms = stays_free and 0 or math.max(tonumber(owner[3] or 0), now + hold_ms)
  redis.call('HSET', record, 'nonce', nonce, 'nonces', remember(owner_nonce, owner_nonces), 'held_until', until_ms)
else
  -- A key no record names yet (the usual new call) has nothing to retire.
  local known = owner_id or owner_state or owner_nonce or owner[5] or owner[7]
  local fields, hn = {}, 0
  if known then
    fields, hn = retire(prefix, record, member, now, history_len, owner_state, owner_id, task_id, grace_ms)
  end
  local function add(...)
    for _, value in ipairs({...}) do
      fields[#fields + 1] = value
    end
  end
  local leased = not queue and lease_ms > 0
  add('task_id', task_id, 'nonce', nonce, 'held_until', now + (leased and lease_ms or hold_ms), 'queued_at', now)
  if args_fp ~= '' then
    add('args_fp', args_fp)
  end
  if leased then
    add('hold_ms', hold_ms)  -- the hold to give once the message is known to be out (confirm.lua, start.lua)
  end
  if argsrepr ~= '' or kwargsrepr ~= '' then
    add('args', argsrepr, 'kwargs', kwargsrepr)
  end
  if payload ~= '' then
    add('payload', payload)
  end
  if debounce then
    local due = now + math.min(window_ms, max_wait_ms)
    add('first_at', now, 'due_at', due, 'message', message, 'queue', queue, 'tag', tag, 'unacked', unacked)
    redis.call('ZADD', due_key, due, member)
    transition(prefix, record, member, 'pending', now, '', history_len, false, fields, {hn, now})
    count(prefix, member, 'accepted')
    return {1, task_id}
  end
  if queue then
    add('queue', queue, 'tag', tag, 'unacked', unacked, 'pushed_at', now)
  end
  transition(prefix, record, member, leased and 'publishing' or 'queued', now, '', history_len, false, fields,
    {hn, now})
  count(prefix, member, 'accepted')
end
if same_run then
  expire_record(record, hold_ms + grace_ms)
end

if queue then
  if same_run then
    redis.call('HSET', record, 'queue', queue, 'tag', tag, 'unacked', unacked, 'pushed_at', now)
  end
  redis.call('LPUSH', queue, message)
  if expires_ms and expires_ms ~= '' then
    for i = 4, #KEYS do
      redis.call('PEXPIRE', KEYS[i], expires_ms)
    end
  end
end
return {1, task_id}
