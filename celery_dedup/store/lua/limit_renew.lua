-- limit_renew: extend the leases of slots held by one process, in one call.
--
-- KEYS[2i-1] slots: lease i's group's slots ZSET (token -> lease deadline, ms)
-- KEYS[2i]   info: its info HASH (kept alive with it)
-- ARGV[1]    lease: lease, ms
-- ARGV[2..]  tokens: lease i's token is tokens[i]
--
-- Returns the 1-based indexes of the leases no longer held (expired and taken
-- back, or evicted): their holders run beyond the group's limit from then on.

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local lost = {}
for i = 1, #tokens do
  local slots, info, token = KEYS[2 * i - 1], KEYS[2 * i], tokens[i]
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
