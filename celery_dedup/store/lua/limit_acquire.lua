-- limit_acquire: may this delivery start now under its group's limits? If so it
-- takes a slot (a lease) and/or a place in every rate window; if not it keeps (or
-- takes) its place in the group's waiting line and learns when to come back.
-- Every key is one group's, or its shard's (one hash tag on a Redis Cluster).
--
-- KEYS[1]  slots: ZSET token -> lease deadline (ms)
-- KEYS[2]  starts: ZSET token -> start (ms), the sliding windows' log (trimmed at the longest period)
-- KEYS[3]  waiting: ZSET run id -> first arrival (ms, to the microsecond), the line in arrival order
-- KEYS[4]  deadlines: waiting deadlines ZSET, run id -> when it must be back (ms) to keep its place
-- KEYS[5]  info: HASH "s:<token>" -> slot start (ms); avg_ms (mean body time,
--          exponentially weighted); concurrency, rates, paused_until (the effective values
--          of the last acquire, for readers) and d_concurrency, d_rates (the declared ones);
--          held_until (ms): free places are held for the runs ahead in line until then
-- KEYS[6]  index: the shard's group index ZSET, group -> last acquire (ms)
-- KEYS[7]  stats: the shard's stats HASH (lib.lua's `count` fields)
-- KEYS[8]  conf: the shard's copy of the group namespace's conf HASH (schema.LIMIT_CONF_FIELDS):
--          group-wide `concurrency`, `rates`, `paused_until`, and `k:<key>:...` for this
--          group's key; a key's value wins over the group's, the group's over the declared;
--          either pause holds; a pause that ended is deleted here (absent for a task's own
--          limits: nothing overridden)
-- ARGV[1]  group: the group id, "<namespace>:<group key>" (a task's or a named group's)
-- ARGV[2]  token: token of this delivery (unique per delivery)
-- ARGV[3]  run: run id (the task id), its place in line survives its re-publishes
-- ARGV[4]  limit: declared concurrency limit (0: none)
-- ARGV[5]  rates: declared windows, "count/period_ms,count/period_ms" ("": no rate limit)
-- ARGV[6]  lease: lease, ms (the execution lock TTL; renewed like it)
-- ARGV[7]  ns: stats field prefix (the escaped task name)
-- ARGV[8..] evict: tokens to evict first, their process is known to be gone
--
-- Returns
--   {1, now, waited_ms, slot}
--                         granted (waited_ms: since its first arrival, 0 if it never waited;
--                         slot: 1 if it took a slot to renew and give back, 0 for starts only);
--                         a run further back gets a free place once the runs ahead it is
--                         held for are overdue (see `held_until`)
--   {0, wait_ms, reason, in_use, position, limit, holder tokens...}
--                         refused: come back in wait_ms; reason "concurrency", "rate" or
--                         "paused"; in_use: slots (concurrency, paused) or starts in the
--                         window that waits longest (rate); position: runs ahead of it in line;
--                         limit: the effective concurrency, the window ("count/period_ms"), or
--                         when the pause ends (ms, "-1": until resumed); the holders' tokens
--                         (concurrency only), to find dead ones
-- While paused every start is refused (a delivery that already holds its slot keeps it): a
-- waiting run keeps its place and comes back every PAUSE_POLL (or when the pause ends, if
-- sooner), so after a resume the line starts in arrival order within PAUSE_POLL.
-- Each window is counted with ZCOUNT and the start a run waits for is read by its rank
-- (ZRANGE i i, O(log N)): the log is never read whole, so 10000/d stays cheap.
-- Counts `limited` (each refusal) and `waited_ms` (on a grant after waiting) in stats.

local slots, starts, waiting, deadlines, info, index, stats, conf =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
-- A refused run comes back no sooner than this (no spinning), and a run that waits for
-- a slot looks again at least once per lease.
local MIN_WAIT = 50
-- Group keys outlive their last use by this much; the index forgets groups idle a day.
local KEEP = 60000
local DAY = 86400000
-- Free places wait for the runs ahead in line until they are due back, and this much longer.
local LATE = 1000
-- A run refused by a pause looks again this often: how soon after a resume the line moves.
local PAUSE_POLL = 5000

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- Arrivals are told apart to the microsecond: two runs arriving in one millisecond keep
-- their order in line (a tie would be broken by run id, not by arrival).
local arrival = tonumber(clock[1]) * 1000 + tonumber(clock[2]) / 1000

local function drop_slot(tok)
  redis.call('ZREM', slots, tok)
  redis.call('HDEL', info, 's:' .. tok)
end

local function extend(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

local function windows_of(text)
  local list = {}
  for count, period in string.gmatch(text, '(%d+)/(%d+)') do
    list[#list + 1] = {tonumber(count), tonumber(period)}
  end
  return list
end

local function longest_of(list)
  local most = 0
  for _, window in ipairs(list) do
    most = math.max(most, window[2])
  end
  return most
end

-- The effective values: this key's override, else the group's, else the declared.
local key = string.sub(group, (string.find(group, ':', 1, true) or 0) + 1)
local set = redis.call('HMGET', conf, 'concurrency', 'rates', 'paused_until',
  'k:' .. key .. ':concurrency', 'k:' .. key .. ':rates', 'k:' .. key .. ':paused_until')
local concurrency = tonumber(set[4] or set[1] or limit) or limit
local rates_now = set[5] or set[2] or rates
local windows = windows_of(rates_now)
local paused_until = 0  -- 0: not paused; -1: until resumed
for _, until_ms in ipairs({tonumber(set[3] or 0) or 0, tonumber(set[6] or 0) or 0}) do
  if until_ms == -1 or paused_until == -1 then
    paused_until = math.min(until_ms, paused_until)
  elseif until_ms > now then
    paused_until = math.max(paused_until, until_ms)
  end
end
-- A pause that has ended leaves no field behind (a back-off writes one per key of the group).
local ended = {}
for i, field in pairs({[3] = 'paused_until', [6] = 'k:' .. key .. ':paused_until'}) do
  local until_ms = tonumber(set[i] or 0) or 0
  if until_ms > 0 and until_ms <= now then
    ended[#ended + 1] = field
  end
end
if #ended > 0 then
  redis.call('HDEL', conf, unpack(ended))
end
-- The log keeps what the longest window needs, declared or overridden (a cleared override finds it whole).
local longest = math.max(longest_of(windows), longest_of(windows_of(rates)))

for _, gone in ipairs(evict) do
  if redis.call('ZSCORE', slots, gone) then
    drop_slot(gone)
    redis.call('HINCRBY', stats, ns .. ':limit_evicted', 1)
  end
end
for _, tok in ipairs(redis.call('ZRANGEBYSCORE', slots, '-inf', now)) do
  drop_slot(tok)  -- a lease nobody renewed: its holder is gone
end
if longest > 0 then
  redis.call('ZREMRANGEBYSCORE', starts, '-inf', now - longest)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', deadlines, '-inf', now)) do
  redis.call('ZREM', waiting, id)  -- not back in time: it lost its place (it queues again if it comes)
  redis.call('ZREM', deadlines, id)
end
redis.call('ZADD', index, now, group)
redis.call('ZREMRANGEBYSCORE', index, '-inf', now - DAY)
redis.call('HSET', info, 'concurrency', concurrency, 'rates', rates_now, 'paused_until', paused_until,
  'd_concurrency', limit, 'd_rates', rates)

local arrived = tonumber(redis.call('ZSCORE', waiting, run) or 0)
local position
if arrived > 0 then
  position = redis.call('ZRANK', waiting, run)
else
  position = redis.call('ZCARD', waiting)
end
local in_use = redis.call('ZCARD', slots)
local keep_ms = math.max(lease, longest) + KEEP
local held = redis.call('ZSCORE', slots, token)

local function refuse(wait, reason, count, limit_text, holders)
  wait = math.max(wait, MIN_WAIT)
  if arrived == 0 then
    redis.call('ZADD', waiting, arrival, run)
  end
  -- It keeps its place while it is expected back: its wait, and a lease for a busy worker.
  redis.call('ZADD', deadlines, now + wait + lease, run)
  redis.call('HINCRBY', stats, ns .. ':limited', 1)
  for _, k in ipairs({slots, starts, info, waiting, deadlines}) do
    extend(k, wait + keep_ms)
  end
  local reply = {0, wait, reason, count, position, limit_text}
  for _, holder in ipairs(holders) do
    reply[#reply + 1] = holder
  end
  return reply
end

if paused_until ~= 0 and not held then
  local wait = PAUSE_POLL
  if paused_until > 0 then
    wait = math.min(wait, paused_until - now)
  end
  redis.call('HDEL', info, 'held_until')
  return refuse(wait, 'paused', in_use, tostring(paused_until), {})
end

local free_slots = concurrency > 0 and concurrency - in_use or math.huge
local used_in, free_starts = {}, math.huge
for i, window in ipairs(windows) do
  used_in[i] = redis.call('ZCOUNT', starts, '(' .. (now - window[2]), '+inf')
  free_starts = math.min(free_starts, window[1] - used_in[i])
end

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

if held or (position < free_slots and position < free_starts) or passes then
  redis.call('HDEL', info, 'held_until')
  if concurrency > 0 then
    redis.call('ZADD', slots, now + lease, token)
    redis.call('HSETNX', info, 's:' .. token, now)
  end
  if #windows > 0 then
    redis.call('ZADD', starts, 'NX', now, token)
  end
  local waited = 0
  if arrived > 0 then
    waited = math.max(0, math.floor(now - arrived))
    redis.call('ZREM', waiting, run)
    redis.call('ZREM', deadlines, run)
    redis.call('HINCRBY', stats, ns .. ':waited_ms', waited)
  end
  for _, key in ipairs({slots, starts, info}) do
    extend(key, keep_ms)
  end
  return {1, now, waited, concurrency > 0 and 1 or 0}
end

-- Refused. When should it look again? When, by the best guess, the place it is
-- next in line for frees: slots end about one mean body time after they began;
-- starts leave a window one period after they were made (in every window it lacks
-- room in: it waits for the last of them). Runs ahead of it in line take the places
-- that free first.
local wait, reason, count, limit_text, holders = 0, '', 0, '', {}
if position >= free_slots then
  reason, count, limit_text = 'concurrency', in_use, tostring(concurrency)
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
  -- A window's starts are the log's newest `used` entries (the log holds nothing newer than now):
  -- with the free places taken at once by the runs ahead, its k-th start to leave is the one it waits for.
  local logged = redis.call('ZCARD', starts)
  for i, window in ipairs(windows) do
    local allowed, period, used = window[1], window[2], used_in[i]
    local free_here = allowed - used
    if position >= free_here then
      local n = used + math.max(free_here, 0)
      local k = position - free_here
      local nth, at = k % n, now
      if nth < used then
        local rank = logged - used + nth
        at = tonumber(redis.call('ZRANGE', starts, rank, rank, 'WITHSCORES')[2])
      end
      local rate_wait = at + period * (math.floor(k / n) + 1) - now
      if rate_wait >= wait then
        wait, reason, count, limit_text = rate_wait, 'rate', used, allowed .. '/' .. period
      end
    end
  end
end
if free > 0 and position < 2 * free then
  wait = math.min(wait, hold - now)  -- next after the runs ahead: the place is its when the hold ends
end
return refuse(wait, reason, count, limit_text, holders)
