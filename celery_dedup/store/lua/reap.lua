-- reap: bounded clean-up of what crashes and expiry leave behind.
--
-- KEYS[1]  held: held set
-- ARGV[1]  prefix: key prefix
-- ARGV[2]  budget: at most this many entries examined per step (step 3: over
--          the indexes it walks; step 4: per index walked, and as many runs
--          first seen missing a grace ago)
-- ARGV[3]  record_ms: record TTL (for runs found dead)
-- ARGV[4]  history_len: history length
-- ARGV[5]  grace_ms: how long a message must stay missing to be judged lost
--
-- Where the reaper stands between calls (P = prefix, M = member):
--   P:reaper:cursor   STRING  step 1's SSCAN cursor
--   P:reaper:walks    HASH    per walked index I: "I:score", "I:member" (the
--                             last entry read) and "I:stop" (see below)
--   P:reaper:missing  ZSET    M -> when its message was first seen missing
--   P:reaper:cursor:following  STRING  step 5's SSCAN cursor
--
-- Five steps:
--   1. held members whose hold deadline passed (or whose record is gone) leave
--      the held set (SSCAN, resuming where the last call stopped); a run still
--      `publishing` then (two-phase gate: its publisher never confirmed within
--      the lease) is marked `lost` (its message, if it reached the broker, may
--      still run it). A record without expiry (gate.lua gives a new one none)
--      gets record_ms then, unless its run may still run: its message parked
--      in it (`pending`) or not missing from its queue (see step 4; a message
--      sent to a broker apart from the store cannot be watched);
--   2. records still `started` whose execution lock is gone belong to a dead
--      worker: marked `lost`, their key released;
--   3. state index entries of records that expired are removed: steps 2 and 4
--      remove those they meet in their walks (started, queued, retry); the
--      other states' indexes are walked here in turn (P:reaper:walks "stale"
--      names the state whose index is walked): a call whose walk of one
--      state's index ends goes on with the next state's, each state at most
--      once per call, until it has examined budget entries;
--   4. queued (or retry-waiting) runs whose message the transport lost after
--      fetching it (kombu's Redis transport pops a message before recording
--      it as unacked: a worker killed in between loses it) are marked lost and
--      their key released. A message is missing when its delivery tag is not
--      in the unacked hash and the oldest message still in its queue was
--      pushed after it (queues are FIFO) or the queue is empty; it is judged
--      lost when it is still missing at the first call at least grace_ms after
--      a look found it missing (a live consumer's fetch, or a restore, is
--      missing only for an instant); P:reaper:missing keeps those looks, so
--      the second look waits for no walk. Any doubt (an ungated oldest
--      message, a restored message at the head) keeps it. Such a run will not
--      run: with dedup_record_args off (its record keeps no argument reprs)
--      the payload its record kept to run it is deleted.
--
-- Steps 2 to 4 walk their index (scored by last update) in score order, each
-- call going on after the last entry the previous call read. A walk covers the
-- entries scored at most its stop, the newest score when it began: entries
-- added or updated meanwhile score later and wait for the next walk, which
-- begins at the call after the walk ends. So a walk takes at most
-- ceil(N / budget) calls (N: entries in the index when it began), and every
-- entry that does not change meanwhile is read once per walk. Entries leaving
-- the index never make a walk skip one. A call goes on after the last entry
-- read before that is still in place; only if another client removed or
-- updated that one too does it go back to the first entry of its score,
-- reading again entries written in that same millisecond.
--
--   5. followers parked longer than grace_ms whose run has ended, or lost its
--      record to another run, are released (SSCAN of P:following, resuming);
--      not those of a run that replaced itself, whose replacement settles them,
--      nor, until its outcome's relay_until, those of a run lost while
--      replacing itself (lib's settle_followers): after it they fail as lost.
-- Returns {expired holds released, dead runs and unconfirmed publishes marked
-- lost, index entries removed, vanished messages' runs marked lost, {member,
-- task id, why, ...} for each run marked lost}.

local held = KEYS[1]
local now = now_ms()
local cursor_key = KEY.reaper_cursor(prefix)
local walks = KEY.reaper_walks(prefix)
local suspects = KEY.reaper_missing(prefix)

-- The next entries of the walk over `index`, as {members, scores, more, stop,
-- after}: `more` if the walk goes on after them, `after` the entry they follow
-- ({member, score}, or nil). At most `limit` entries (default: budget). Pass it
-- all to `walked` once they were examined.
local function walk(index, limit)
  limit = limit or budget
  local at = redis.call('HMGET', walks, index .. ':score', index .. ':member', index .. ':stop')
  local first, stop, after = 0, at[3], nil
  if stop then
    local score = redis.call('ZSCORE', index, at[2])
    if score and tonumber(score) == tonumber(at[1]) then
      first = redis.call('ZRANK', index, at[2]) + 1
      after = {at[2], at[1]}
    else
      first = redis.call('ZCOUNT', index, '-inf', '(' .. at[1])
    end
  else
    local newest = redis.call('ZRANGE', index, -1, -1, 'WITHSCORES')
    if #newest == 0 then
      return {members = {}, scores = {}, more = false}
    end
    stop = newest[2]
  end
  local last = tonumber(stop)
  -- One entry more than is read: whether the walk goes on after these.
  local entries = redis.call('ZRANGE', index, first, first + limit, 'WITHSCORES')
  local step = {members = {}, scores = {}, more = false, stop = stop, after = after}
  for i = 1, #entries, 2 do
    if tonumber(entries[i + 1]) > last then
      break
    end
    if #step.members == limit then
      step.more = true
      break
    end
    step.members[#step.members + 1] = entries[i]
    step.scores[#step.scores + 1] = entries[i + 1]
  end
  return step
end

-- Save where the walk over `index` stands: after the last entry it has read
-- that is still in the index at the same score, or else at the first entry of
-- the last read one's score. A walk that does not go on ends: the next call
-- begins the next walk.
local function walked(index, step)
  if not step.more then
    redis.call('HDEL', walks, index .. ':score', index .. ':member', index .. ':stop')
    return
  end
  local candidates = {}
  for i = #step.members, 1, -1 do
    candidates[#candidates + 1] = {step.members[i], step.scores[i]}
  end
  candidates[#candidates + 1] = step.after
  local saved = candidates[1]
  for _, entry in ipairs(candidates) do
    local score = redis.call('ZSCORE', index, entry[1])
    if score and tonumber(score) == tonumber(entry[2]) then
      saved = entry
      break
    end
  end
  redis.call('HSET', walks, index .. ':score', saved[2], index .. ':member', saved[1], index .. ':stop', step.stop)
end

local reaped = {}
local function reap(member, task_id, why)
  table.insert(reaped, member)
  table.insert(reaped, task_id)
  table.insert(reaped, why)
  count(prefix, member, 'reaped')
end

-- The push time of the oldest message in `queue`: false if it is empty, -1 if
-- unknown. Queues do not change while this script runs: each is read once.
local heads = {}
local function oldest_pushed(queue)
  if heads[queue] ~= nil then
    return heads[queue]
  end
  local found = -1
  local head = redis.call('LINDEX', queue, -1)
  if not head then
    found = false
  else
    local ok, decoded = pcall(cjson.decode, head)
    local headers = ok and type(decoded) == 'table' and decoded['headers']
    local gate = type(headers) == 'table' and headers['dedup']
    if type(gate) == 'table' and type(gate['member']) == 'string' then
      local head_record = redis.call('HMGET', KEY.record(prefix, gate['member']), 'tag', 'pushed_at')
      local props = type(decoded['properties']) == 'table' and decoded['properties'] or {}
      -- Otherwise a restored or superseded copy: its own push time is not known.
      if head_record[1] == props['delivery_tag'] then
        found = tonumber(head_record[2]) or -1
      end
    end
  end
  heads[queue] = found
  return found
end

-- Whether the message of the run in `record` is missing (see step 4).
local function message_missing(record)
  local r = redis.call('HMGET', record, 'queue', 'tag', 'unacked', 'pushed_at')
  local pushed_at = tonumber(r[4] or 0)
  if not r[1] or pushed_at <= 0 or pushed_at >= now - grace_ms or redis.call('HEXISTS', r[3], r[2]) == 1 then
    return false
  end
  local head = oldest_pushed(r[1])
  return head == false or head > pushed_at
end

local released, lost = 0, 0
local scan = redis.call('SSCAN', held, redis.call('GET', cursor_key) or '0', 'COUNT', budget)
redis.call('SET', cursor_key, scan[1])
for _, member in ipairs(scan[2]) do
  local record = KEY.record(prefix, member)
  local current = redis.call('HMGET', record, 'held_until', 'state', 'task_id')
  local until_ms = current[1]
  if not until_ms or tonumber(until_ms) <= now then
    redis.call('SREM', held, member)
    released = released + 1
    if current[2] == 'publishing' then
      local why = 'its publisher never confirmed the publish within its lease'
      redis.call('HSET', record, 'held_until', 0, 'finished_at', now)
      transition(prefix, record, member, 'lost', now, 'reaped: publish lease ended', history_len, current[2])
      expire_record(record, record_ms)
      lost = lost + 1
      reap(member, current[3], why)
    elseif current[2] and current[2] ~= 'pending' and redis.call('PTTL', record) == -1 then
      if not redis.call('HGET', record, 'queue') or message_missing(record) then
        expire_record(record, record_ms)
      end
    end
  end
end

local stale = 0
-- An index entry of a record that expired: removed.
local function stale_entry(member, state)
  if redis.call('EXISTS', KEY.record(prefix, member)) == 0 then
    unindex(prefix, member, state)
    stale = stale + 1
    return true
  end
  return false
end

local started_index = KEY.state_index(prefix, 'started')
local started = walk(started_index)
for _, member in ipairs(started.members) do
  local record = KEY.record(prefix, member)
  if not stale_entry(member, 'started') and redis.call('EXISTS', KEY.lock(prefix, member)) == 0 then
    local task_id = redis.call('HGET', record, 'task_id') or ''
    redis.call('HDEL', record, 'lock')
    redis.call('HSET', record, 'held_until', 0, 'finished_at', now)
    redis.call('SREM', held, member)
    transition(prefix, record, member, 'lost', now, 'reaped: lock expired', history_len)
    expire_record(record, record_ms)
    settle_followers(prefix, member, task_id, 'lost', 'its worker died: lock expired while started', '', record_ms)
    lost = lost + 1
    reap(member, task_id, 'its worker died: lock expired while started')
  end
end
walked(started_index, started)

local STALE_STATES = {}
for _, state in ipairs(STATES) do
  if state ~= 'started' and state ~= 'queued' and state ~= 'retry' then
    STALE_STATES[#STALE_STATES + 1] = state
  end
end
local stale_at = 1
local stale_state = redis.call('HGET', walks, 'stale')
for i, state in ipairs(STALE_STATES) do
  if state == stale_state then
    stale_at = i
  end
end
local left = budget
for _ = 1, #STALE_STATES do
  local index = KEY.state_index(prefix, STALE_STATES[stale_at])
  local indexed = walk(index, left)
  for _, member in ipairs(indexed.members) do
    stale_entry(member, STALE_STATES[stale_at])
  end
  walked(index, indexed)
  left = left - #indexed.members
  if indexed.more then
    break  -- the budget is spent: the next call goes on with this walk
  end
  -- This state's walk ended: the next state's index is walked next, in this call while budget is left.
  stale_at = stale_at % #STALE_STATES + 1
  if left <= 0 then
    break
  end
end
redis.call('HSET', walks, 'stale', STALE_STATES[stale_at])

local vanished = 0
local waiting_states = {queued = true, retry = true}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', suspects, '-inf', now - grace_ms, 'LIMIT', 0, budget)) do
  redis.call('ZREM', suspects, member)
  local record = KEY.record(prefix, member)
  local r = redis.call('HMGET', record, 'state', 'missing_since', 'task_id')
  -- No missing_since: the run started since (or was replaced by another run).
  if r[2] and waiting_states[r[1]] then
    redis.call('HDEL', record, 'missing_since')
    if message_missing(record) then
      local task_id = r[3] or ''
      redis.call('SREM', held, member)
      redis.call('HSET', record, 'held_until', 0, 'finished_at', now)
      if redis.call('HEXISTS', record, 'args') == 0 and redis.call('HEXISTS', record, 'kwargs') == 0 then
        redis.call('HDEL', record, 'payload')
      end
      transition(prefix, record, member, 'lost', now, 'message lost by the transport', history_len)
      expire_record(record, record_ms)
      settle_followers(prefix, member, task_id, 'lost', 'message lost by the transport', '', record_ms)
      vanished = vanished + 1
      reap(member, task_id, 'message lost by the transport')
    end
  end
end
for _, state in ipairs({'queued', 'retry'}) do
  local state_index = KEY.state_index(prefix, state)
  local waiting = walk(state_index)
  for _, member in ipairs(waiting.members) do
    local record = KEY.record(prefix, member)
    local since = redis.call('HGET', record, 'missing_since')
    if stale_entry(member, state) then
      -- Its record expired.
    elseif message_missing(record) then
      if not since then
        redis.call('HSET', record, 'missing_since', now)
        redis.call('ZADD', suspects, now, member)
      end
    elseif since then
      redis.call('HDEL', record, 'missing_since')
      redis.call('ZREM', suspects, member)
    end
  end
  walked(state_index, waiting)
end
-- 5. Followers still parked a grace after their run ended (and after they
-- were parked), or after their run's record passed to another run (its worker
-- died between recording the ending and settling them, or the run's hold ran
-- out): released with the outcome recorded for their run, or as lost when none
-- was. Not while the key's lock is held by a delivery the record does not
-- name and their run is not known to have ended: that may be their run, still
-- executing after its record passed on, whose ending settles them.
local following = KEY.following(prefix)
local look = redis.call('SSCAN', following, redis.call('GET', KEY.reaper_following_cursor(prefix)) or '0', 'COUNT', budget)
redis.call('SET', KEY.reaper_following_cursor(prefix), look[1])
for _, member in ipairs(look[2]) do
  local followers = KEY.followers(prefix, member)
  local entries = redis.call('HGETALL', followers)
  if #entries == 0 then
    redis.call('SREM', following, member)
  end
  local r = redis.call('HMGET', KEY.record(prefix, member), 'task_id', 'state', 'finished_at', 'ended', 'lock')
  -- The key's lock, held by a delivery its record does not name: a run whose record passed on while it
  -- executes (a window that ran out before it started), unless that is a run known to have ended.
  local running = redis.call('GET', KEY.lock(prefix, member))
  if running and running == r[5] then
    running = false
  end
  local outcomes = KEY.outcomes(prefix, member)
  -- A run that replaced itself: its replacement, not the run, settles them (lib's settle_followers);
  -- a run lost while replacing itself, only until its outcome's relay_until.
  local function replaced(run)
    local ok, outcome = pcall(cjson.decode, redis.call('HGET', outcomes, run) or '')
    return ok and (outcome.state == 'replaced' or tonumber(outcome.relay_until or 0) > now)
  end
  local settled = {}
  for i = 1, #entries, 2 do
    local ok, follower = pcall(cjson.decode, entries[i + 1])
    local run = ok and follower.run
    local waiting = run and (r[1] == run and not ENDED[r[2]] and r[2] ~= 'lost' or follower.message and replaced(run)
      or r[1] ~= run and running and not has_ended(prefix, member, r[4] or '', run))
    -- A grace after the run's ending too: a success hands its value over in the round trip after recording it.
    local since = math.max(tonumber(follower.at or 0), r[1] == run and tonumber(r[3] or 0) or 0)
    if run and follower.message and not waiting and not settled[run] and since <= now - grace_ms then
      settled[run] = true
      if not settled_outcome(prefix, member, run) then
        local ok, held_back = pcall(cjson.decode, redis.call('HGET', outcomes, run) or '')
        local why = ok and held_back.error or 'its run ended without settling its followers'
        record_outcome(prefix, member, run, 'lost', why, '', record_ms)
      end
      release_followers(prefix, member, run)
    end
  end
end
return {released, lost, stale, vanished, reaped}
