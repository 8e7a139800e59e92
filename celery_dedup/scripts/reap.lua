-- reap: bounded clean-up of what crashes and expiry leave behind.
--
-- KEYS[1]  held set
-- ARGV[1]  key prefix
-- ARGV[2]  at most this many entries examined per step
-- ARGV[3]  record TTL, ms (for runs found dead)
-- ARGV[4]  history length
--
-- Three steps, each examining at most ARGV[2] entries:
--   1. held members whose hold deadline passed (or whose record is gone) leave
--      the held set (SSCAN, resuming where the last call stopped);
--   2. records still `started` whose execution lock is gone belong to a dead
--      worker: marked `lost`, their key released;
--   3. index entries of records that expired are removed (oldest first).
-- Returns {expired holds released, dead runs marked lost, index entries removed}.

local held, prefix = KEYS[1], ARGV[1]
local budget, record_ms, history_len = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local cursor_key = prefix .. ':reaper:cursor'

local released = 0
local scan = redis.call('SSCAN', held, redis.call('GET', cursor_key) or '0', 'COUNT', budget)
redis.call('SET', cursor_key, scan[1])
for _, member in ipairs(scan[2]) do
  local until_ms = redis.call('HGET', prefix .. ':rec:' .. member, 'held_until')
  if not until_ms or tonumber(until_ms) <= now then
    redis.call('SREM', held, member)
    released = released + 1
  end
end

local lost = 0
local started = redis.call('ZRANGE', prefix .. ':idx:state:started', 0, budget - 1)
for _, member in ipairs(started) do
  local record = prefix .. ':rec:' .. member
  if redis.call('EXISTS', prefix .. ':lock:' .. member) == 0 and redis.call('EXISTS', record) == 1 then
    local task_id = redis.call('HGET', record, 'task_id') or ''
    redis.call('HDEL', record, 'lock')
    redis.call('HSET', record, 'held_until', 0, 'finished_at', now)
    redis.call('SREM', held, member)
    transition(prefix, record, member, 'lost', now, task_id, 'reaped: lock expired', history_len)
    expire_record(prefix, record, member, record_ms)
    lost = lost + 1
  end
end

local stale = 0
local oldest = redis.call('ZRANGE', prefix .. ':idx', 0, budget - 1)
for _, member in ipairs(oldest) do
  if redis.call('EXISTS', prefix .. ':rec:' .. member) == 0 then
    unindex(prefix, member)
    stale = stale + 1
  end
end
return {released, lost, stale}
