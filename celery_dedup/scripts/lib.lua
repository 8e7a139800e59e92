-- lib: helpers prepended to every script that changes a status record.
-- Not a script of its own: no KEYS, no ARGV. Key names built here follow the
-- schema in keys.py (P = prefix, M = member):
--   P:idx            ZSET M -> last update (ms)       all records, newest first
--   P:idx:state:S    ZSET M -> last update            records in state S
--   P:idx:task:T     ZSET M -> last update            records of task T
--   P:idx:name       ZSET M -> 0                      prefix search (ZRANGEBYLEX)
--   P:hist:M         LIST of "ms state task_id [note]", newest first, capped

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Move M's record to `state`: fields, indexes and history, in one place.
local function transition(prefix, record, member, state, now, task_id, note, history_len)
  local current = redis.call('HMGET', record, 'state', 'task')
  local old, task = current[1], current[2]
  redis.call('HSET', record, 'state', state, 'updated_at', now)
  local idx = prefix .. ':idx'
  redis.call('ZADD', idx, now, member)
  redis.call('ZADD', idx .. ':name', 0, member)
  if old and old ~= state then
    redis.call('ZREM', idx .. ':state:' .. old, member)
  end
  redis.call('ZADD', idx .. ':state:' .. state, now, member)
  if task then
    redis.call('ZADD', idx .. ':task:' .. task, now, member)
  end
  if history_len > 0 then
    local entry = now .. ' ' .. state .. ' ' .. task_id
    if note and note ~= '' then
      entry = entry .. ' ' .. note
    end
    local hist = prefix .. ':hist:' .. member
    redis.call('LPUSH', hist, entry)
    redis.call('LTRIM', hist, 0, history_len - 1)
  end
end

-- Expire M's record (and its history with it) in `ms` milliseconds.
local function expire_record(prefix, record, member, ms)
  redis.call('PEXPIRE', record, ms)
  redis.call('PEXPIRE', prefix .. ':hist:' .. member, ms)
end

-- Delete M's record, its history and its index entries.
local function forget(prefix, record, member)
  local current = redis.call('HMGET', record, 'state', 'task')
  local idx = prefix .. ':idx'
  redis.call('ZREM', idx, member)
  redis.call('ZREM', idx .. ':name', member)
  if current[1] then
    redis.call('ZREM', idx .. ':state:' .. current[1], member)
  end
  if current[2] then
    redis.call('ZREM', idx .. ':task:' .. current[2], member)
  end
  redis.call('DEL', record, prefix .. ':hist:' .. member)
end

