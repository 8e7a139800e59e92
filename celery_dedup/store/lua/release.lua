-- release: an operator frees a stuck key. Owner-safe: a live execution lock is
-- deleted only when forced, and only while it still holds the token the
-- operator was shown (compare-and-delete).
--
-- KEYS[1]  held: held set
-- KEYS[2]  record: the member's status record (HASH)
-- KEYS[3]  lock: the member's execution lock
-- ARGV[1]  member
-- ARGV[2]  prefix: key prefix
-- ARGV[3]  history_len: history length
-- ARGV[4]  record_ms: record TTL, how long the record is kept after the release
-- ARGV[5]  force: "" not forced; else the lock token to delete if the lock is alive
-- ARGV[6]  who: who releases it (for the history note), may be ""
--
-- Only something held is released: the key (in the held set) or a live
-- lock (deleted when forced). Releasing drops the member from the held set
-- and sets held_until 0. A record whose run has not ended (queued, started,
-- retry, lost, ...) moves to the ended state `released`: its queued message
-- or a redelivered copy is then skipped by the delivery guard. An ended
-- record keeps its state; the release is noted in its history either way,
-- and counted. With nothing held, nothing is written.
--
-- Returns {code, detail, was_held, forced}:
--   {1, state, was_held, forced}  released; state: the record's state now
--                                 ("" if there is no record)
--   {0, pttl, 0, 0}               refused: the lock is alive and force is ""
--   {2, holder, 0, 0}             refused: the lock is alive under another
--                                 token than force (it changed meanwhile)
--   {3, state, 0, 0}              nothing to release: the key is not held and
--                                 no lock is alive; state: the record's ("" if
--                                 there is no record)

local held, record, lock = KEYS[1], KEYS[2], KEYS[3]

local holder = redis.call('GET', lock)
local forced = 0
if holder then
  if force == '' then
    return {0, redis.call('PTTL', lock), 0, 0}
  end
  if holder ~= force then
    return {2, holder, 0, 0}
  end
  redis.call('DEL', lock)
  forced = 1
end

local was_held = redis.call('SREM', held, member)
local current = redis.call('HMGET', record, 'state', 'task_id', 'lock')
local state, task_id = current[1], current[2]
if was_held == 0 and forced == 0 then
  return {3, state or '', 0, 0}
end
if not state then
  return {1, '', was_held, forced}
end

local now = now_ms()
-- Who released it comes first: a long note is cut (lib's history_value).
local note = 'released'
if forced == 1 then
  note = 'forced release'
  if current[3] == holder then
    redis.call('HSETNX', record, 'lock_lost_at', now)
  end
end
if who ~= '' then
  note = note .. ' by ' .. who
end
if forced == 1 then
  note = note .. ', lock ' .. holder .. ' deleted'
end
redis.call('HSET', record, 'held_until', 0)
if not ENDED[state] then
  redis.call('HSET', record, 'finished_at', now)
  state = 'released'
  settle_followers(prefix, member, task_id or '', 'released', note, '', record_ms)
end
redis.call('HDEL', record, unpack(UNENDED_ONLY))  -- ended now (or before): what only an unended run needs goes
transition(prefix, record, member, state, now, note, history_len)
count(prefix, member, 'released')
expire_record(record, record_ms)
return {1, state, was_held, forced}
