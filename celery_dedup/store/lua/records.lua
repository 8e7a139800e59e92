-- records: one page of status records, newest update first, merged from the per-state indexes.
--
-- KEYS[i]  state_index: the indexes to merge, P:idx:state:<state>, one per state of `states`
-- ARGV[1]  record_prefix: the records' key prefix ("P:rec:"): a member's record is record_prefix .. member
-- ARGV[2]  task_prefix: only members that start with it ("<escaped task name>:"); "" for every task
-- ARGV[3]  after_score: the page starts after this position: its score (ms); "" for the newest entry
-- ARGV[4]  after_member: ... and its member
-- ARGV[5]  limit: records wanted
-- ARGV[6]  budget: index entries looked at, at most
-- ARGV[7..] states: KEYS[i]'s state, in order
--
-- Read only; it reads the members' records (P:rec:M) besides its KEYS, all
-- in the slot of P. Page order is score (the member's last update) highest
-- first, and among equal scores member highest first in byte order, as
-- ZREVRANGEBYSCORE gives them: a position (score, member) names a place in
-- that order whether or not its entry still exists, so a record that moves
-- to another state (scored anew) neither shifts nor repeats the entries
-- after the cursor. An entry is shown when its record exists and is in the
-- index's state (an entry whose record expired is skipped: the reaper
-- removes it). Both stored formats keep these indexes.
--
-- Returns {done, score, member, total, found}: done 1 when no entry is left
-- after the last one looked at; (score, member) that entry's position ("",
-- "" when none was); total the entries of KEYS; found a flat list of score,
-- member and the record's HGETALL (a table), per record shown.

local function before(a, b)
  -- a sorts before b in a sorted set's member order: by bytes (Lua's `<` follows the server's locale)
  if a == b then
    return false
  end
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return #a < #b
end

local batch = limit + 1

-- Up to `n` entries of `key` after position (score, member) in page order: {{score, member, score as a number}, ...}.
local function fetch(key, score, member, n)
  local out = {}
  local rest
  if score then
    for _, m in ipairs(redis.call('ZREVRANGEBYSCORE', key, score, score)) do
      if before(m, member) then
        out[#out + 1] = {score, m, tonumber(score)}
        if #out == n then
          return out
        end
      end
    end
    rest = redis.call('ZREVRANGEBYSCORE', key, '(' .. score, '-inf', 'WITHSCORES', 'LIMIT', 0, n - #out)
  else
    rest = redis.call('ZREVRANGEBYSCORE', key, '+inf', '-inf', 'WITHSCORES', 'LIMIT', 0, n)
  end
  for i = 1, #rest, 2 do
    out[#out + 1] = {rest[i + 1], rest[i], tonumber(rest[i + 1])}
  end
  return out
end

local start_score = after_score ~= '' and after_score or nil
local streams, total = {}, 0
for i, key in ipairs(KEYS) do
  local size = redis.call('ZCARD', key)
  total = total + size
  if size > 0 then  -- most states' indexes are empty: nothing to fetch or merge
    local entries = fetch(key, start_score, after_member, batch)
    streams[#streams + 1] = {key = key, state = states[i], entries = entries, at = 1, more = #entries == batch}
  end
end

local found, shown, scanned = {}, 0, 0
local last_score, last_member = '', ''
local tp_len = #task_prefix
while shown < limit and scanned < budget do
  local best, best_entry = nil, nil
  for _, stream in ipairs(streams) do
    local entry = stream.entries[stream.at]
    if entry then
      if not best_entry then
        best, best_entry = stream, entry
      else
        local s, b = entry[3], best_entry[3]
        if s > b or (s == b and before(best_entry[2], entry[2])) then
          best, best_entry = stream, entry
        end
      end
    end
  end
  if not best then
    break
  end
  best.at = best.at + 1
  if best.at > #best.entries and best.more then
    best.entries = fetch(best.key, best_entry[1], best_entry[2], batch)
    best.at, best.more = 1, #best.entries == batch
  end
  scanned = scanned + 1
  last_score, last_member = best_entry[1], best_entry[2]
  local member = best_entry[2]
  if tp_len == 0 or string.sub(member, 1, tp_len) == task_prefix then
    local record = redis.call('HGETALL', record_prefix .. member)
    for i = 1, #record, 2 do
      if record[i] == 'state' then
        if record[i + 1] == best.state then
          found[#found + 1] = best_entry[1]
          found[#found + 1] = member
          found[#found + 1] = record
          shown = shown + 1
        end
        break
      end
    end
  end
end

local done = 1
for _, stream in ipairs(streams) do
  if stream.entries[stream.at] then
    done = 0
  end
end
return {done, last_score, last_member, total, found}
