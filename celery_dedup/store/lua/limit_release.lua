-- limit_release: a delivery gives back what limit_acquire gave it.
--
-- KEYS[1]  slots: ZSET token -> lease deadline (ms)
-- KEYS[2]  starts: ZSET token -> start (ms), the rate window's log
-- KEYS[3]  info: HASH ("s:<token>" -> slot start, avg_ms; see limit_acquire.lua)
-- ARGV[1]  token
-- ARGV[2]  ran: "1" if the body ran (its time feeds the mean body time and its start
--          stays in the rate window); "0" if it did not (a copy refused by the
--          execution guard, a follower): its start is taken back
--
-- Returns 1 if the token held a live slot or a start, 2 if it held a slot whose
-- lease had lapsed (past its deadline, not yet taken back), else 0 (none: never
-- taken, or taken back after its lease lapsed, or evicted).

local slots, starts, info = KEYS[1], KEYS[2], KEYS[3]

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

local deadline = tonumber(redis.call('ZSCORE', slots, token) or 0)
local held = redis.call('ZREM', slots, token)
local since = tonumber(redis.call('HGET', info, 's:' .. token) or 0)
redis.call('HDEL', info, 's:' .. token)
if ran and held == 1 and since > 0 then
  local took = now - since
  local avg = tonumber(redis.call('HGET', info, 'avg_ms') or 0)
  if avg > 0 then
    took = math.floor(avg * 0.8 + took * 0.2)
  end
  redis.call('HSET', info, 'avg_ms', math.max(took, 1))
end
local logged = 0
if not ran then
  logged = redis.call('ZREM', starts, token)
end
if held == 1 and deadline <= now then
  return 2
end
if held == 1 or logged == 1 then
  return 1
end
return 0
