-- renew: extend every execution lock this worker process holds, in one call.
--
-- KEYS[2i-1] lock: pair i's execution lock
-- KEYS[2i]   record: its member's status record
-- ARGV[1]    lock_ms: lock TTL
-- ARGV[2]    record_ms: record TTL (how long a record outlives its hold)
-- ARGV[3..]  tokens: the tokens, one per pair, in order
--
-- Returns the 1-based pair numbers whose lock is no longer this token's (lost:
-- expired or taken over); their records get `lock_lost_at`. A renewed lock's
-- key stays held at least as long as the lock, while the record is its run's
-- (it names this token): the record of a run accepted since (the key was
-- released when this one started) is not this lock's to touch.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lost = {}
for i = 1, #KEYS / 2 do
  local lock, record, token = KEYS[2 * i - 1], KEYS[2 * i], tokens[i]
  if redis.call('GET', lock) == token then
    redis.call('PEXPIRE', lock, lock_ms)
    local r = redis.call('HMGET', record, 'lock', 'held_until')
    if r[1] == token then
      local held_until = tonumber(r[2] or 0)
      if held_until > 0 and held_until < now + lock_ms then
        redis.call('HSET', record, 'held_until', now + lock_ms)
      end
      if redis.call('PTTL', record) < lock_ms + record_ms then
        redis.call('PEXPIRE', record, lock_ms + record_ms)
      end
    end
  else
    lost[#lost + 1] = i
    if redis.call('HGET', record, 'lock') == token then
      redis.call('HSETNX', record, 'lock_lost_at', now)
    end
  end
end
return lost
