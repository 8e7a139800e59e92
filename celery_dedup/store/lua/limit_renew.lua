-- limit_renew: extend the leases of slots held by one process, in one call.
--
-- KEYS[2i-1], KEYS[2i]  lease i's group: slots ZSET (token -> lease deadline, ms)
--                       and info HASH (kept alive with it)
-- ARGV[1]               lease, ms
-- ARGV[1+i]             lease i's token
--
-- Returns the 1-based indexes of the leases no longer held (expired and taken
-- back, or evicted): their holders run beyond the group's limit from then on.

local lease = tonumber(ARGV[1])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lost = {}
for i = 1, #ARGV - 1 do
  local slots, info, token = KEYS[2 * i - 1], KEYS[2 * i], ARGV[i + 1]
  local deadline = tonumber(redis.call('ZSCORE', slots, token) or 0)
  if deadline > now then
    redis.call('ZADD', slots, 'XX', now + lease, token)
    for _, key in ipairs({slots, info}) do
      if redis.call('PTTL', key) < lease + 60000 then
        redis.call('PEXPIRE', key, lease + 60000)
      end
    end
  else
    lost[#lost + 1] = i
  end
end
return lost
