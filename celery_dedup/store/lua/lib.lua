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

-- Count one decision about M for its task: accepted, deduplicated, mismatched, collapsed,
-- followed, skipped, deferred, taken_over, lock_lost, released, reaped (fail_open comes from Python).
local function count(prefix, member, decision, amount)
  local ns = split_member(member)
  redis.call('HINCRBY', KEY.stats(prefix), ns .. ':' .. decision, amount or 1)
end

-- A call answered with M's run (a duplicate, a follower, a join) whose arguments
-- fingerprint `given` differs from the run's (`accepted`; both "" when not
-- taken): counted in the record (`mismatched`) and the stats.
local function note_mismatch(prefix, record, member, given, accepted)
  if given ~= '' and accepted ~= '' and given ~= accepted then
    redis.call('HINCRBY', record, 'mismatched', 1)
    count(prefix, member, 'mismatched')
  end
end

-- History (format 2) lives in the record, one field per entry: `h<n>`, n
-- counting up per record (newest: highest), and `hn`, the next n; at most
-- history_len entries (writing entry n deletes h<n - history_len>). A value is
-- "<offset> <state>" or "<offset> <state> <run> [note]": <offset> is the
-- entry's time (ms) minus the record's `queued_at` (negative for entries
-- carried from earlier runs), <run> "-" for the record's own run, else the id
-- of the run the entry is about. A value stays <= HISTORY_VALUE_MAX bytes, so
-- the record stays a listpack: the note is cut to fit, never the run id.
local HISTORY_VALUE_MAX = 64

local function history_value(offset, state, run, note)
  local value = string.format('%d', offset) .. ' ' .. state
  if run == '-' and (not note or note == '') then
    return value
  end
  value = value .. ' ' .. run
  if note and note ~= '' then
    local room = HISTORY_VALUE_MAX - #value - 1
    if room > 0 then
      if #note > room then
        -- Cut at a character's first byte, not inside a UTF-8 sequence.
        while room > 0 and string.byte(note, room + 1) >= 128 and string.byte(note, room + 1) < 192 do
          room = room - 1
        end
        note = string.sub(note, 1, room)
      end
      if note ~= '' then
        value = value .. ' ' .. note
      end
    end
  end
  return value
end

-- A history value read back: offset (number), state, run ("-" for the record's own), note.
local function parse_history(value)
  local offset, state, rest = string.match(value, '^(%-?%d+) (%S+)(.*)$')
  if not offset then
    return nil
  end
  local run, note = '-', ''
  if rest ~= '' then
    run, note = string.match(rest, '^ (%S+) ?(.*)$')
  end
  return tonumber(offset), state, run or '-', note or ''
end

-- Add entry n (`value`) to the field-value pairs `fields` of the record's next
-- HSET, with `hn`; the entry it pushes out of the history is deleted now.
local function push_history(record, n, value, history_len, fields)
  if n >= history_len then
    redis.call('HDEL', record, 'h' .. (n - history_len))
  end
  fields[#fields + 1], fields[#fields + 2] = 'h' .. n, value
  fields[#fields + 1], fields[#fields + 2] = 'hn', n + 1
end

-- Move M's record to `state`: fields, state index and history, in one place.
-- `known_old`: the record's state if the caller knows it (false: none); nil: read it.
-- `fields`: more field-value pairs of the record to set in the same HSET.
-- `base`: {hn, queued_at} of the record when the caller knows them (nil: read).
-- The history entry is about the record's own run.
-- With CHECK, the move is reported to the server's log (schema.py checks it).
local function transition(prefix, record, member, state, now, note, history_len, known_old, fields, base)
  local old = known_old
  local hn, queued_at
  if base then
    hn, queued_at = base[1], base[2]
  end
  if old == nil or (history_len > 0 and not base) then
    local r = redis.call('HMGET', record, 'state', 'hn', 'queued_at')
    if old == nil then
      old = r[1]
    end
    if not base then
      hn, queued_at = tonumber(r[2] or 0), tonumber(r[3])
    end
  end
  if CHECK then
    redis.log(redis.LOG_WARNING, REPORT_MARK .. ' ' .. SCRIPT .. ' ' .. (old or NO_RECORD) .. ' ' .. state .. ' ' .. member)
  end
  local set = {'state', state}
  for _, value in ipairs(fields or {}) do
    set[#set + 1] = value
  end
  if history_len > 0 then
    if not queued_at then
      queued_at = now  -- every record has one: the entries' times count from it
      set[#set + 1], set[#set + 2] = 'queued_at', now
    end
    push_history(record, hn, history_value(now - queued_at, state, '-', note), history_len, set)
  end
  redis.call('HSET', record, unpack(set))
  -- P:idx:name holds every member some state index holds: a member no state index held gets its name.
  local indexed = false
  if old and old ~= state then
    indexed = redis.call('ZREM', KEY.state_index(prefix, old), member) == 1
  end
  local added = redis.call('ZADD', KEY.state_index(prefix, state), now, member)
  if old and old == state then
    indexed = added == 0
  end
  if not indexed then
    local ns, key = split_member(member)
    redis.call('ZADD', KEY.name_index(prefix), 0, key .. '\0' .. ns)
  end
end

-- Expire M's record (its history is inside it) in `ms` milliseconds.
local function expire_record(record, ms)
  redis.call('PEXPIRE', record, ms)
end

-- The fields a run needs only until it has ended (where its message is, who
-- delivered it, what to push): a final ending deletes them.
local UNENDED_ONLY = {'tag', 'unacked', 'pushed_at', 'main', 'hold_ms', 'message', 'queue'}

-- STATES and ENDED (the prelude): every state a record can be in, and those in
-- which its run has ended: a delivery of an ended run never runs, and a later
-- report never rewrites it. `lost` is not an end: a copy of a lost run may
-- still run and finish it. What each means: store/schema.py.

-- Remove M from every index; `state`, when known, spares trying every state index.
local function unindex(prefix, member, state)
  local ns, key = split_member(member)
  redis.call('ZREM', KEY.name_index(prefix), key .. '\0' .. ns)
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
-- released when it started: "passed on"), or lost, with why (its hold expired,
-- or its lock did). The new record's `queued_at` is `now`.
-- Returns the fields the new record keeps of the old (see REMEMBERED) and its
-- history's entries (the old run's, "-" replaced by its id, rebased on `now`,
-- renumbered from h0), and the new record's `hn`; an ended run pushed out of
-- them is kept `keep_ms` (see remember_ended).
local function retire(prefix, record, member, now, history_len, old_state, old_task_id, new_task_id, keep_ms)
  local kept = redis.call('HMGET', record, 'nonce', 'nonces', 'ended', 'began', 'started_at', 'hn', 'queued_at')
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
  local entries = {}  -- {time (ms), state, run, note}, oldest first
  if history_len > 0 then
    local hn, base = tonumber(kept[6] or 0), tonumber(kept[7] or now)
    local names = {}
    for n = math.max(0, hn - history_len), hn - 1 do
      names[#names + 1] = 'h' .. n
    end
    if #names > 0 then
      for _, value in ipairs(redis.call('HMGET', record, unpack(names))) do
        local offset, state, run, note = false, nil, nil, nil
        if value then
          offset, state, run, note = parse_history(value)
        end
        if offset then
          entries[#entries + 1] = {offset + base, state, run == '-' and (old_task_id or '-') or run, note}
        end
      end
    end
    if old_state and not ENDED[old_state] and old_state ~= 'lost' then
      local entry = {now, 'lost', old_task_id or '-', 'expired; taken over'}
      if running then
        entry = {now, 'started', old_task_id or '-', 'passed on'}
      elseif old_state == 'started' then
        entry = {now, 'lost', old_task_id or '-', 'key taken over'}
      end
      entries[#entries + 1] = entry
    end
  end
  local first = math.max(1, #entries - history_len + 1)
  for i = first, #entries do
    local e = entries[i]
    carry[#carry + 1], carry[#carry + 2] = 'h' .. (i - first), history_value(e[1] - now, e[2], e[3], e[4])
  end
  local hn = math.max(0, #entries - first + 1)
  if hn > 0 then
    carry[#carry + 1], carry[#carry + 2] = 'hn', hn
  end
  if old_state then
    unindex(prefix, member, old_state)
  end
  redis.call('DEL', record)
  return carry, hn
end

-- Delete M's record (its history with it) and its index entries.
local function forget(prefix, record, member)
  unindex(prefix, member, redis.call('HGET', record, 'state') or nil)
  redis.call('DEL', record)
end

-- Cut M's record down to what later decisions about its run depend on, for
-- as long as the record would have lived (a record without expiry keeps
-- none): the run's id and ending (a late copy of the run is skipped, see
-- start.lua) and what it remembers of earlier runs (see REMEMBERED).
-- Everything else goes: the other fields, the history and the index entries.
local function tombstone(prefix, record, member)
  local kept = redis.call('HMGET', record, 'task_id', 'state', 'nonce', 'nonces', 'ended', 'began')
  local ttl = redis.call('PTTL', record)
  unindex(prefix, member, kept[2] or nil)
  redis.call('DEL', record)
  -- ttl -2: no record; -1: a record without expiry, whose tombstone has none either.
  if not kept[1] or not kept[2] or ttl == -2 or ttl == 0 then
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
  if ttl > 0 then
    redis.call('PEXPIRE', record, ttl)
  end
end

-- Steps (worker/steps.py, step_begin.lua, step_end.lua) -------------------------
-- A step's entry in M's history: "<offset> step <run> <note>", <run> "-" when
-- the record is that run's. Nothing when histories are off or M has no record.
local function step_history(record, run, note, now, history_len)
  if history_len <= 0 then
    return
  end
  local r = redis.call('HMGET', record, 'task_id', 'hn', 'queued_at')
  if not r[1] then
    return
  end
  local entry = {}
  local value = history_value(now - tonumber(r[3] or now), 'step', r[1] == run and '-' or run, note)
  push_history(record, tonumber(r[2] or 0), value, history_len, entry)
  redis.call('HSET', record, unpack(entry))
end

-- A steps hash of M (`steps`: the key's, or a run's) lives at least as long
-- as M's record, as long as a record lives after a renewal of its lock
-- (`lock_ms` + `record_ms`), and past the record's window (until_expired,
-- throttle: finish.lua holds the key to `window_until`): steps outlive the
-- run that did them, and each use keeps them `record_ms` longer. A hash
-- that does not exist stays so.
local function keep_steps(steps, record, now, lock_ms, record_ms)
  local keep = math.max(lock_ms + record_ms, redis.call('PTTL', record), redis.call('PTTL', steps))
  local window = tonumber(redis.call('HGET', record, 'window_until') or 0)
  if window > 0 then
    keep = math.max(keep, window - now + record_ms)
  end
  redis.call('PEXPIRE', steps, keep)
end
