-- reap: bounded clean-up of what crashes and expiry leave behind.
--
-- KEYS[1]  held set
-- ARGV[1]  key prefix
-- ARGV[2]  at most this many entries examined per step
-- ARGV[3]  record TTL, ms (for runs found dead)
-- ARGV[4]  history length
-- ARGV[5]  grace, ms: younger queued runs are not examined in step 4
--
-- Three steps, each examining at most ARGV[2] entries:
--   1. held members whose hold deadline passed (or whose record is gone) leave
--      the held set (SSCAN, resuming where the last call stopped);
--   2. records still `started` whose execution lock is gone belong to a dead
--      worker: marked `lost`, their key released;
--   3. index entries of records that expired are removed (oldest first);
--   4. queued (or retry-waiting) runs whose message the transport lost after
--      fetching it (kombu's Redis transport pops a message before recording
--      it as unacked: a worker killed in between loses it) are marked lost and
--      their key released. A message is missing when its delivery tag is not
--      in the unacked hash and the oldest message still in its queue was
--      pushed after it (queues are FIFO) or the queue is empty; it is judged
--      lost when it is missing at two passes at least ARGV[5] apart (a live
--      consumer's fetch, or a restore, is missing only for an instant). Any
--      doubt (an ungated oldest message, a restored message at the head)
--      keeps it.
-- Returns {expired holds released, dead runs marked lost, index entries
-- removed, vanished messages' runs marked lost, {member, task id, why, ...}
-- for each run marked lost}.

local held, prefix = KEYS[1], ARGV[1]
local budget, record_ms, history_len = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local grace_ms = tonumber(ARGV[5])
local now = now_ms()
local cursor_key = prefix .. ':reaper:cursor'

local reaped = {}
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
    count(prefix, member, 'reaped')
    lost = lost + 1
    table.insert(reaped, member)
    table.insert(reaped, task_id)
    table.insert(reaped, 'its worker died: lock expired while started')
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
-- The push time of the oldest message in `queue`, false if it is empty, nil if unknown.
local function oldest_pushed(queue)
  local head = redis.call('LINDEX', queue, -1)
  if not head then
    return false
  end
  local ok, decoded = pcall(cjson.decode, head)
  local gate = ok and decoded['headers'] and decoded['headers']['dedup']
  if type(gate) ~= 'table' or type(gate['member']) ~= 'string' then
    return nil
  end
  local head_record = redis.call('HMGET', prefix .. ':rec:' .. gate['member'], 'tag', 'pushed_at')
  local props = decoded['properties'] or {}
  if head_record[1] ~= props['delivery_tag'] then
    return nil  -- a restored or superseded copy: its own push time is not known
  end
  return tonumber(head_record[2])
end

local vanished = 0
for _, state in ipairs({'queued', 'retry'}) do
  local waiting = redis.call('ZRANGE', prefix .. ':idx:state:' .. state, 0, budget - 1)
  for _, member in ipairs(waiting) do
    local record = prefix .. ':rec:' .. member
    local r = redis.call('HMGET', record, 'queue', 'tag', 'unacked', 'pushed_at', 'task_id')
    local pushed_at = tonumber(r[4] or 0)
    local missing = false
    if r[1] and pushed_at > 0 and pushed_at < now - grace_ms
        and redis.call('HEXISTS', r[3], r[2]) == 0 then
      local head = oldest_pushed(r[1])
      missing = head == false or (head and head > pushed_at)
    end
    -- A message between a consumer's BRPOP and its unacked entry, or being
    -- restored, is missing for an instant: only one missing at two looks a
    -- grace apart is lost.
    local since = tonumber(redis.call('HGET', record, 'missing_since') or 0)
    if not missing then
      if since > 0 then
        redis.call('HDEL', record, 'missing_since')
      end
    elseif since == 0 then
      redis.call('HSET', record, 'missing_since', now)
    elseif since <= now - grace_ms then
      redis.call('HDEL', record, 'missing_since')
      redis.call('SREM', held, member)
      redis.call('HSET', record, 'held_until', 0, 'finished_at', now)
      transition(prefix, record, member, 'lost', now, r[5] or '', 'message lost by the transport', history_len)
      expire_record(prefix, record, member, record_ms)
      count(prefix, member, 'reaped')
      vanished = vanished + 1
      table.insert(reaped, member)
      table.insert(reaped, r[5] or '')
      table.insert(reaped, 'message lost by the transport')
    end
  end
end
return {released, lost, stale, vanished, reaped}
