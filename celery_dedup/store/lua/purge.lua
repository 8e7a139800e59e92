-- purge: delete finished status records now, a bounded number per call.
--
-- KEYS[1]   held: held set
-- ARGV[1]   prefix: key prefix
-- ARGV[2]   budget: at most this many index entries examined in this call
-- ARGV[3..] states: the states to purge; only ended states (lib's ENDED) are taken
--
-- Walks each state's index oldest update first. A record whose key is held
-- (an idempotency window) or whose execution lock is alive is kept and
-- stepped over; any other leaves the indexes with its history, and is cut
-- down to a tombstone that lives as long as the record would have (lib's
-- tombstone): a late copy of its run is still skipped, a retried publish
-- still recognised. Its run's steps go with it (that copy is skipped before
-- any step); earlier runs' steps expire on their own, the key's steps stay. An index entry whose record expired is removed, and an
-- entry whose record is in another, unended state is only removed from this
-- index.
--
-- Returns {purged, kept, more}: more is 1 when the budget ran out before
-- every entry of the given states was examined (call again).

local held = KEYS[1]

local examined, purged, kept, more = 0, 0, 0, 0
for _, wanted in ipairs(states) do
  if ENDED[wanted] then
    local index = KEY.state_index(prefix, wanted)
    local offset = 0
    while more == 0 do
      if examined >= budget then
        if redis.call('ZCARD', index) > offset then
          more = 1
        end
        break
      end
      local batch = redis.call('ZRANGE', index, offset, offset + budget - examined - 1)
      if #batch == 0 then
        break
      end
      for _, member in ipairs(batch) do
        examined = examined + 1
        local record = KEY.record(prefix, member)
        if redis.call('SISMEMBER', held, member) == 1 or redis.call('EXISTS', KEY.lock(prefix, member)) == 1 then
          kept = kept + 1
          offset = offset + 1
        else
          local state = redis.call('HGET', record, 'state')
          if not state or ENDED[state] then
            local run = redis.call('HGET', record, 'task_id')
            if run then
              redis.call('DEL', KEY.run_steps(prefix, member, run))
            end
            tombstone(prefix, record, member)
            purged = purged + 1
          end
          redis.call('ZREM', index, member)
        end
      end
    end
  end
end
return {purged, kept, more}
