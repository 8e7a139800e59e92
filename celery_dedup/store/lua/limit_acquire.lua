-- limit_acquire: may this delivery start now under its group's limits? If so it
-- takes a slot (a lease) and/or a place in the rate window; if not it keeps (or
-- takes) its place in the group's waiting line and learns when to come back.
-- Every key is one group's, or its shard's (one hash tag on a Redis Cluster).
--
-- KEYS[1]  slots: ZSET token -> lease deadline (ms)
-- KEYS[2]  starts: ZSET token -> start (ms), the sliding rate window's log
-- KEYS[3]  waiting: ZSET run id -> first arrival (ms), the line in arrival order
-- KEYS[4]  deadlines: waiting deadlines ZSET, run id -> when it must be back (ms) to keep its place
-- KEYS[5]  info: HASH "s:<token>" -> slot start (ms); avg_ms (mean body time,
--          exponentially weighted); concurrency, rate, period_ms (the last limits seen);
--          held_until (ms): free places are held for the runs ahead in line until then
-- KEYS[6]  index: the shard's group index ZSET, group -> last acquire (ms)
-- KEYS[7]  stats: the shard's stats HASH (lib.lua's `count` fields)
-- ARGV[1]  group: namespaced like a member, "<escaped task name>:<group key>"
-- ARGV[2]  token: token of this delivery (unique per delivery)
-- ARGV[3]  run: run id (the task id), its place in line survives its re-publishes
-- ARGV[4]  limit: concurrency limit (0: none)
-- ARGV[5]  rate: starts allowed per period (0: no rate limit)
-- ARGV[6]  period: rate period, ms
-- ARGV[7]  lease: lease, ms (the execution lock TTL; renewed like it)
-- ARGV[8]  ns: stats field prefix (the escaped task name)
-- ARGV[9..] evict: tokens to evict first, their process is known to be gone
--
-- Returns
--   {1, now, waited_ms}   granted (waited_ms: since its first arrival, 0 if it never waited);
--                         a run further back gets a free place once the runs ahead it is
--                         held for are overdue (see `held_until`)
--   {0, wait_ms, reason, in_use, position, holder tokens...}
--                         refused: come back in wait_ms; reason "concurrency" or
--                         "rate"; in_use: slots (concurrency) or starts in the window
--                         (rate); position: runs ahead of it in line; the holders'
--                         tokens (concurrency only), to find dead ones
-- Counts `limited` (each refusal) and `waited_ms` (on a grant after waiting) in stats.

local slots, starts, waiting, deadlines, info, index, stats =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
-- A refused run comes back no sooner than this (no spinning), and a run that waits for
-- a slot looks again at least once per lease.
local MIN_WAIT = 50
-- Group keys outlive their last use by this much; the index forgets groups idle a day.
local KEEP = 60000
local DAY = 86400000
-- Free places wait for the runs ahead in line until they are due back, and this much longer.
local LATE = 1000

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local function drop_slot(tok)
  redis.call('ZREM', slots, tok)
  redis.call('HDEL', info, 's:' .. tok)
end

local function extend(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

for _, gone in ipairs(evict) do
  if redis.call('ZSCORE', slots, gone) then
    drop_slot(gone)
    redis.call('HINCRBY', stats, ns .. ':limit_evicted', 1)
  end
end
for _, tok in ipairs(redis.call('ZRANGEBYSCORE', slots, '-inf', now)) do
  drop_slot(tok)  -- a lease nobody renewed: its holder is gone
end
if rate > 0 then
  redis.call('ZREMRANGEBYSCORE', starts, '-inf', now - period)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', deadlines, '-inf', now)) do
  redis.call('ZREM', waiting, id)  -- not back in time: it lost its place (it queues again if it comes)
  redis.call('ZREM', deadlines, id)
end
redis.call('ZADD', index, now, group)
redis.call('ZREMRANGEBYSCORE', index, '-inf', now - DAY)
redis.call('HSET', info, 'concurrency', limit, 'rate', rate, 'period_ms', period)

local arrived = tonumber(redis.call('ZSCORE', waiting, run) or 0)
local position
if arrived > 0 then
  position = redis.call('ZRANK', waiting, run)
else
  position = redis.call('ZCARD', waiting)
end
local in_use = redis.call('ZCARD', slots)
local free_slots = limit > 0 and limit - in_use or math.huge
local used = rate > 0 and redis.call('ZCARD', starts) or 0
local free_starts = rate > 0 and rate - used or math.huge
local keep_ms = math.max(lease, period) + KEEP

-- Places free now but promised to runs ahead in line are held for them only while they are
-- expected back (at most one lease from the first refusal): a line whose head is late (its
-- message held up or lost) must not keep a free place from a run that is here.
local free = math.min(free_slots, free_starts)
local passes, hold = false, 0
if free > 0 and position >= free then
  hold = tonumber(redis.call('HGET', info, 'held_until') or 0)
  if hold == 0 then
    local due = 0
    for _, id in ipairs(redis.call('ZRANGE', waiting, 0, free - 1)) do
      due = math.max(due, tonumber(redis.call('ZSCORE', deadlines, id) or 0) - lease)
    end
    hold = math.min(due + LATE, now + lease)
    redis.call('HSET', info, 'held_until', hold)
  end
  passes = now >= hold
else
  redis.call('HDEL', info, 'held_until')
end

if redis.call('ZSCORE', slots, token) or (position < free_slots and position < free_starts) or passes then
  redis.call('HDEL', info, 'held_until')
  if limit > 0 then
    redis.call('ZADD', slots, now + lease, token)
    redis.call('HSETNX', info, 's:' .. token, now)
  end
  if rate > 0 then
    redis.call('ZADD', starts, 'NX', now, token)
  end
  local waited = 0
  if arrived > 0 then
    waited = now - arrived
    redis.call('ZREM', waiting, run)
    redis.call('ZREM', deadlines, run)
    redis.call('HINCRBY', stats, ns .. ':waited_ms', waited)
  end
  for _, key in ipairs({slots, starts, info}) do
    extend(key, keep_ms)
  end
  return {1, now, waited}
end

-- Refused. When should it look again? When, by the best guess, the place it is
-- next in line for frees: slots end about one mean body time after they began;
-- starts leave the window one period after they were made. Runs ahead of it in
-- line take the places that free first.
local wait, reason, count, holders = 0, '', 0, {}
if position >= free_slots then
  reason, count = 'concurrency', in_use
  local avg = tonumber(redis.call('HGET', info, 'avg_ms') or 0)
  if avg <= 0 then
    avg = math.min(lease, 1000)  -- nothing has ended yet: look again in a second
  end
  local ends = {}
  for _, entry in ipairs(redis.call('ZRANGE', slots, 0, -1)) do
    holders[#holders + 1] = entry
    local since = tonumber(redis.call('HGET', info, 's:' .. entry) or now)
    ends[#ends + 1] = math.max(since + avg, now + MIN_WAIT)
  end
  for _ = 1, math.max(free_slots, 0) do
    ends[#ends + 1] = now + avg  -- taken at once by runs ahead in line, free again after a body
  end
  table.sort(ends)
  local k = position - math.max(free_slots, 0)
  wait = ends[(k % #ends) + 1] + math.floor(k / #ends) * avg - now
  wait = math.min(wait, lease)
end
if position >= free_starts then
  local window = {}
  local logged = redis.call('ZRANGE', starts, 0, -1, 'WITHSCORES')
  for i = 2, #logged, 2 do
    window[#window + 1] = tonumber(logged[i])
  end
  for _ = 1, math.max(free_starts, 0) do
    window[#window + 1] = now
  end
  local k = position - math.max(free_starts, 0)
  local rate_wait = window[(k % #window) + 1] + period * (math.floor(k / #window) + 1) - now
  if rate_wait >= wait then
    wait, reason, count = rate_wait, 'rate', used
  end
end
if free > 0 and position < 2 * free then
  wait = math.min(wait, hold - now)  -- next after the runs ahead: the place is its when the hold ends
end
wait = math.max(wait, MIN_WAIT)
if arrived == 0 then
  redis.call('ZADD', waiting, now, run)
end
-- It keeps its place while it is expected back: its wait, and a lease for a busy worker.
redis.call('ZADD', deadlines, now + wait + lease, run)
redis.call('HINCRBY', stats, ns .. ':limited', 1)
for _, key in ipairs({slots, starts, info, waiting, deadlines}) do
  extend(key, wait + keep_ms)
end
local reply = {0, wait, reason, count, position}
for _, holder in ipairs(holders) do
  reply[#reply + 1] = holder
end
return reply
