-- lib: helpers prepended to every script that changes a status record.
-- Not a script of its own: no KEYS, no ARGV. Before it comes the prelude that
-- store/schema.py generates: SCRIPT (this script's name), STATES, ENDED, the
-- key builders KEY.<kind>(prefix[, part]) and CHECK (the transitions report).
-- P = prefix, M = member; a member M is N ":" K, and N holds no ":".

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function split_member(member)
  local colon = string.find(member, ':', 1, true)
  return string.sub(member, 1, colon - 1), string.sub(member, colon + 1)
end

-- Count one decision about M for its task: accepted, deduplicated, collapsed, followed,
-- skipped, deferred, taken_over, lock_lost, released, reaped (fail_open comes from Python).
local function count(prefix, member, decision, amount)
  local ns = split_member(member)
  redis.call('HINCRBY', KEY.stats(prefix), ns .. ':' .. decision, amount or 1)
end

-- Move M's record to `state`: fields, indexes and history, in one place.
-- `known_old`: the record's state if the caller knows it (false: none); nil: read it.
-- `fields`: more field-value pairs of the record to set in the same HSET.
-- With CHECK, the move is reported to the server's log (schema.py checks it).
local function transition(prefix, record, member, state, now, task_id, note, history_len, known_old, fields)
  local old = known_old
  if old == nil then
    old = redis.call('HGET', record, 'state')
  end
  if CHECK then
    redis.log(redis.LOG_WARNING, REPORT_MARK .. ' ' .. SCRIPT .. ' ' .. (old or NO_RECORD) .. ' ' .. state .. ' ' .. member)
  end
  local ns, key = split_member(member)
  redis.call('HSET', record, 'state', state, 'updated_at', now, unpack(fields or {}))
  if redis.call('ZADD', KEY.index(prefix), now, member) == 1 then
    -- P:idx and P:idx:name gain and lose M together (unindex): only a new entry needs its name.
    redis.call('ZADD', KEY.name_index(prefix), 0, key .. '\0' .. ns)
  end
  if old and old ~= state then
    redis.call('ZREM', KEY.state_index(prefix, old), member)
  end
  redis.call('ZADD', KEY.state_index(prefix, state), now, member)
  redis.call('ZADD', KEY.task_index(prefix, ns), now, member)
  if history_len > 0 then
    local entry = now .. ' ' .. state .. ' ' .. task_id
    if note and note ~= '' then
      entry = entry .. ' ' .. note
    end
    local hist = KEY.history(prefix, member)
    if redis.call('LPUSH', hist, entry) > history_len then
      redis.call('LTRIM', hist, 0, history_len - 1)
    end
  end
end

-- Expire M's record (and its history with it) in `ms` milliseconds.
local function expire_record(prefix, record, member, ms)
  redis.call('PEXPIRE', record, ms)
  redis.call('PEXPIRE', KEY.history(prefix, member), ms)
end

-- STATES and ENDED (the prelude): every state a record can be in, and those in
-- which its run has ended: a delivery of an ended run never runs, and a later
-- report never rewrites it. `lost` is not an end: a copy of a lost run may
-- still run and finish it. What each means: store/schema.py.

-- Remove M from every index; `state`, when known, spares trying every state index.
local function unindex(prefix, member, state)
  local ns, key = split_member(member)
  redis.call('ZREM', KEY.index(prefix), member)
  redis.call('ZREM', KEY.name_index(prefix), key .. '\0' .. ns)
  redis.call('ZREM', KEY.task_index(prefix, ns), member)
  for _, candidate in ipairs(state and {state} or STATES) do
    redis.call('ZREM', KEY.state_index(prefix, candidate), member)
  end
end

-- How run `run` of M ended, for its followers (start.lua hands it to each):
-- JSON {state, error, result}, `result` the run's return value as
-- gate.result_payload serialized it ("" when it was not kept).
-- The first outcome settled for a run stands: a later ending recorded for it
-- (a `lost` report after its replacement relayed a success, a copy of a run
-- declared lost that finishes after all) changes nothing, so its followers,
-- whenever their deliveries read it, all get one answer. Only an outcome that
-- waits for a replacement's ending (see settled_outcome) gives way.
-- Only outcomes someone can still ask for stay: this run's, the run the
-- record names (a key held after success answers its window's followers with
-- it), and those of runs whose followers have yet to read them (parked, or
-- released and on their way). So a key that keeps running keeps at most
-- max_followers + 2 of them, not one per run.
-- `relay_until` (ms, optional): the outcome is `lost` for a run that was
-- replacing itself (its record's `replacing`), held back until then for its
-- replacement's ending (see settle_followers and reap.lua's step 5).

-- The outcome recorded for `run` of M if it is settled (JSON), else nil: a
-- `replaced` outcome, or one held back for a relay, waits for the replacement.
local function settled_outcome(prefix, member, run)
  local entry = redis.call('HGET', KEY.outcomes(prefix, member), run)
  if not entry then
    return nil
  end
  local ok, outcome = pcall(cjson.decode, entry)
  if ok and type(outcome) == 'table' and (outcome.state == 'replaced' or outcome.relay_until) then
    return nil
  end
  return entry
end

local function record_outcome(prefix, member, run, state, err, result, ttl_ms, relay_until)
  local outcomes = KEY.outcomes(prefix, member)
  if settled_outcome(prefix, member, run) then
    return
  end
  local outcome = {state = state, error = err or '', result = result or ''}
  if relay_until then
    outcome.relay_until = relay_until
  end
  redis.call('HSET', outcomes, run, cjson.encode(outcome))
  redis.call('PEXPIRE', outcomes, ttl_ms)
  if redis.call('HLEN', outcomes) == 1 then
    return
  end
  local wanted = {[run] = true}
  local current = redis.call('HGET', KEY.record(prefix, member), 'task_id')
  if current then
    wanted[current] = true
  end
  for _, entry in ipairs(redis.call('HVALS', KEY.followers(prefix, member))) do
    local ok, follower = pcall(cjson.decode, entry)
    if ok and follower.run then
      wanted[follower.run] = true
    end
  end
  for _, kept in ipairs(redis.call('HKEYS', outcomes)) do
    if not wanted[kept] then
      redis.call('HDEL', outcomes, kept)
    end
  end
end

-- Push the parked messages of `run`'s followers onto their queues (gate.lua
-- parked them); each delivery then resolves as the run ended (start.lua).
-- Returns how many were pushed.
local function release_followers(prefix, member, run)
  local key = KEY.followers(prefix, member)
  local entries = redis.call('HGETALL', key)
  local released = 0
  for i = 1, #entries, 2 do
    local ok, follower = pcall(cjson.decode, entries[i + 1])
    if ok and follower.run == run and follower.message then
      redis.call('LPUSH', follower.queue, follower.message)
      redis.call('HSET', key, entries[i], cjson.encode({run = run}))
      released = released + 1
    end
  end
  return released
end

-- Record how `run` ended and release its followers, if it has any waiting
-- (or `result` is to be kept for followers still to come: a key held after
-- success). A success whose return value is not given yet returns true: the
-- caller settles it with the value (settle.lua).
-- A run `replaced` by work under another key or a plain task has not given
-- its followers anything yet: they stay parked, for as long as the run's
-- record is kept, until its replacement's ending settles them (settle.lua,
-- relay.py), and the outcome says so meanwhile (the reaper leaves them). If
-- that ending came first, they are released with it now.
-- A run `lost` while its record says it was `replacing` itself (the mark is
-- set before the replacement is published, see replacing.lua) may have
-- published a replacement carrying its id: its followers wait for that
-- replacement's ending as after `replaced`, but only until the record would
-- have expired (`ttl_ms` from now); then the reaper fails them as lost, as
-- nothing relayed an ending (the worker died before the publish, or the
-- replacement never ended).
local function settle_followers(prefix, member, run, state, err, result, ttl_ms)
  local outcomes, followers = KEY.outcomes(prefix, member), KEY.followers(prefix, member)
  local relay = false
  if state == 'lost' then
    local r = redis.call('HMGET', KEY.record(prefix, member), 'task_id', 'replacing')
    relay = r[1] == run and r[2] ~= false
  end
  if state == 'replaced' or relay then
    if settled_outcome(prefix, member, run) then
      release_followers(prefix, member, run)
    elseif redis.call('EXISTS', followers) == 1 then
      local keep_ms = ttl_ms
      if relay then
        -- Kept a record's lifetime past the deadline, for the reaper to fail them.
        keep_ms = 2 * ttl_ms
        if not redis.call('HGET', outcomes, run) then
          err = (err ~= '' and err .. '; ' or '') .. 'nothing carrying its replacement ended it'
          record_outcome(prefix, member, run, state, err, '', keep_ms, now_ms() + ttl_ms)
        end
      else
        record_outcome(prefix, member, run, state, err, '', keep_ms)
      end
      redis.call('PEXPIRE', followers, math.max(redis.call('PTTL', followers), keep_ms))
    end
    return false
  end
  if result == '' and redis.call('EXISTS', followers) == 0 then
    return false
  end
  if state == 'succeeded' and result == '' then
    return true
  end
  record_outcome(prefix, member, run, state, err, result, ttl_ms)
  release_followers(prefix, member, run)
  return false
end

-- A record remembers a few words across runs of its key (space-separated, newest
-- first, in fields short enough to keep the record a listpack): `nonces`, the
-- nonces of the key's last accepted publishes before `nonce` (gate.lua),
-- `ended`, fingerprints of its last ended runs (start.lua, gate.lua), and
-- `began`, fingerprints of its last runs that had begun but not ended when the
-- record passed on (confirm.lua: their message was out), so a replay of a run
-- (or its late confirm) is recognised after the record has passed to another run.
local REMEMBERED = 3

local function remembers(text, word)
  return text ~= nil and (' ' .. text .. ' '):find(' ' .. word .. ' ', 1, true) ~= nil
end

-- `word` (if any) before the words of `older`, at most REMEMBERED of them.
local function remember(word, older)
  local kept = {}
  if word then
    kept[1] = word
  end
  for other in string.gmatch(older or '', '%S+') do
    if #kept >= REMEMBERED then
      break
    end
    kept[#kept + 1] = other
  end
  return table.concat(kept, ' ')
end

-- A run's fingerprint in `ended`: 48 bits of its id's SHA-1.
local function fingerprint(task_id)
  return string.sub(redis.sha1hex(task_id), 1, 12)
end

-- A record's `ended` holds its key's last REMEMBERED ended runs; runs pushed
-- out of it go to P:ended:M (fingerprint -> when, ms), kept for `keep_ms` and
-- at most ENDED_KEPT of them: a late copy of a run of a busy key (a deferred
-- copy, a redelivery after many runs of a while_executing key) is still
-- recognised. Quiet keys never write it.
local ENDED_KEPT = 1000

-- `ended` with run `task_id` remembered; returns the new field value.
local function remember_ended(prefix, member, task_id, ended, now, keep_ms)
  local kept = remember(fingerprint(task_id), ended)
  local overflow = KEY.ended(prefix, member)
  for word in string.gmatch(ended or '', '%S+') do
    if not remembers(kept, word) then
      redis.call('ZADD', overflow, now, word)
      redis.call('ZREMRANGEBYSCORE', overflow, '-inf', now - keep_ms)
      redis.call('ZREMRANGEBYRANK', overflow, 0, -ENDED_KEPT - 1)
      redis.call('PEXPIRE', overflow, keep_ms)
    end
  end
  return kept
end

-- Whether run `task_id` of M ended before its record passed on (`ended` is
-- the record's field).
local function has_ended(prefix, member, ended, task_id)
  local word = fingerprint(task_id)
  return remembers(ended, word) or redis.call('ZSCORE', KEY.ended(prefix, member), word) ~= false
end

-- Whether run `task_id` of M had begun (a worker started it) but not ended
-- when its record passed on (`began` is the record's field).
local function has_begun(began, task_id)
  return remembers(began, fingerprint(task_id))
end

-- Replace M's record (in `old_state`, of run `old_task_id`; both false if there
-- is none) by run `new_task_id`'s: the old one leaves the indexes, and a run
-- that had not ended is noted in the history: still running (its key was
-- released when it started), or lost, with why (its lock or its hold expired).
-- Returns the fields the new record keeps of the old (see REMEMBERED); an
-- ended run pushed out of them is kept `keep_ms` (see remember_ended).
local function retire(prefix, record, member, now, history_len, old_state, old_task_id, new_task_id, keep_ms)
  local kept = redis.call('HMGET', record, 'nonce', 'nonces', 'ended', 'began', 'started_at')
  local carry = {}
  local nonces = remember(kept[1], kept[2])
  local ended, began = kept[3] or '', kept[4] or ''
  if old_state and ENDED[old_state] and old_task_id then
    ended = remember_ended(prefix, member, old_task_id, ended, now, keep_ms)
  elseif old_task_id and kept[5] then
    began = remember(fingerprint(old_task_id), began)
  end
  if nonces ~= '' then
    carry[#carry + 1], carry[#carry + 2] = 'nonces', nonces
  end
  if ended ~= '' then
    carry[#carry + 1], carry[#carry + 2] = 'ended', ended
  end
  if began ~= '' then
    carry[#carry + 1], carry[#carry + 2] = 'began', began
  end
  local running = old_state == 'started' and redis.call('EXISTS', KEY.lock(prefix, member)) == 1
  if old_state and not ENDED[old_state] and old_task_id and not running then
    settle_followers(prefix, member, old_task_id, 'lost', 'its hold expired before it ended; key taken over by '
      .. new_task_id, '', math.max(redis.call('PTTL', record), 60000))
  end
  if old_state and not ENDED[old_state] and old_state ~= 'lost' and history_len > 0 then
    local entry = ' lost ' .. (old_task_id or '') .. ' hold expired; key taken over by ' .. new_task_id
    if running then
      entry = ' started ' .. (old_task_id or '') .. ' still running; key passed to the next run'
    elseif old_state == 'started' then
      entry = ' lost ' .. (old_task_id or '') .. ' key taken over'
    end
    local hist = KEY.history(prefix, member)
    redis.call('LPUSH', hist, now .. entry)
    redis.call('LTRIM', hist, 0, history_len - 1)
  end
  if old_state then
    unindex(prefix, member, old_state)
  end
  redis.call('DEL', record)
  return carry
end

-- Delete M's record, its history and its index entries.
local function forget(prefix, record, member)
  unindex(prefix, member, redis.call('HGET', record, 'state') or nil)
  redis.call('DEL', record, KEY.history(prefix, member))
end

-- Cut M's record down to what later decisions about its run depend on, for
-- as long as the record would have lived: the run's id and ending (a late copy
-- of the run is skipped, see start.lua) and what it remembers of earlier runs
-- (see REMEMBERED). Everything else goes: the
-- other fields, the history and the index entries.
local function tombstone(prefix, record, member)
  local kept = redis.call('HMGET', record, 'task_id', 'state', 'nonce', 'nonces', 'ended', 'began')
  local ttl = redis.call('PTTL', record)
  unindex(prefix, member, kept[2] or nil)
  redis.call('DEL', record, KEY.history(prefix, member))
  if not kept[1] or not kept[2] or ttl <= 0 then
    return
  end
  local fields = {'task_id', kept[1], 'state', kept[2], 'purged', 1}
  if kept[3] then
    fields[#fields + 1], fields[#fields + 2] = 'nonce', kept[3]
  end
  if kept[4] then
    fields[#fields + 1], fields[#fields + 2] = 'nonces', kept[4]
  end
  if kept[5] then
    fields[#fields + 1], fields[#fields + 2] = 'ended', kept[5]
  end
  if kept[6] then
    fields[#fields + 1], fields[#fields + 2] = 'began', kept[6]
  end
  redis.call('HSET', record, unpack(fields))
  redis.call('PEXPIRE', record, ttl)
end
