"""Lua scripts: every state change that must be atomic runs as one script on the server.

Layout of a prompt-stream entry: one field `group` holding the PromptGroup JSON. An entry leaves
the stream (XACK + XDEL together) only when it is completed or dead-lettered, so
XLEN(prompts) = groups queued + groups leased, which is what the queue bound limits.
Why each check exists is explained in docs/coordination.md.
"""

from __future__ import annotations

# KEYS: prompts, stats. ARGV: max_queue, payload...  -> {1, ids} or {0, depth}
ENQUEUE = """
local n = #ARGV - 1
local depth = redis.call('XLEN', KEYS[1])
if depth + n > tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[2], 'refused', n)
  return {0, depth}
end
local ids = {}
for i = 2, #ARGV do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'group', ARGV[i])
end
redis.call('HINCRBY', KEYS[2], 'enqueued', n)
return {1, ids}
"""

# KEYS: prompts, dead, stats, worker hash, trainer version, reclaim cursor, trajectories, in-flight limit.
# ARGV: consumer group, worker id, count, lease ttl ms, max attempts, staleness bound.
# -> {0} when the worker lags or the in-flight window is full, else
#    {1, {{entry id, attempt, fields}, ...}, groups the caller may still take (window room)}.
# Expired leases first (XAUTOCLAIM, attempt = delivery count), then new entries (attempt 1).
# In-flight window: groups leased plus trajectories the trainer has not read yet stay within the
# limit the trainer sets, so rollouts never run further ahead than the trainer can consume within
# max_lag versions (docs/coordination.md).
CLAIM = """
local group, consumer, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
local max_attempts = tonumber(ARGV[5])
local wv = redis.call('HGET', KEYS[4], 'weight_version')
if wv then
  local tv = tonumber(redis.call('GET', KEYS[5]) or '0')
  if tonumber(wv) < tv - tonumber(ARGV[6]) then
    redis.call('HINCRBY', KEYS[3], 'lagging_refusals', 1)
    return {0}
  end
end
local limit = tonumber(redis.call('GET', KEYS[8]) or '0')
if limit > 0 then
  local leased = 0
  if redis.call('EXISTS', KEYS[1]) == 1 then leased = redis.call('XPENDING', KEYS[1], group)[1] end
  local room = limit - leased - redis.call('XLEN', KEYS[7])
  if room <= 0 then
    redis.call('HINCRBY', KEYS[3], 'window_refusals', 1)
    return {0}
  end
  if room < want then want = room end
end
local leases = {}
local reclaimed, dead = 0, 0
local cursor = redis.call('GET', KEYS[6]) or '0-0'
local r = redis.call('XAUTOCLAIM', KEYS[1], group, consumer, ARGV[4], cursor, 'COUNT', want)
redis.call('SET', KEYS[6], r[1])
for _, e in ipairs(r[2]) do
  if e and e[2] then
    local id = e[1]
    local attempt = redis.call('XPENDING', KEYS[1], group, id, id, 1)[1][4]
    if attempt > max_attempts then
      local payload = ''
      for i = 1, #e[2], 2 do
        if e[2][i] == 'group' then payload = e[2][i + 1] end
      end
      redis.call('XACK', KEYS[1], group, id)
      redis.call('XDEL', KEYS[1], id)
      redis.call('XADD', KEYS[2], '*', 'entry_id', id, 'group', payload, 'attempts', attempt - 1,
        'reason', 'max_attempts: ' .. (attempt - 1) .. ' leases expired without completion')
      dead = dead + 1
    else
      leases[#leases + 1] = {id, attempt, e[2]}
      reclaimed = reclaimed + 1
    end
  end
end
if #leases < want then
  local fresh = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', want - #leases,
    'STREAMS', KEYS[1], '>')
  if fresh then
    for _, e in ipairs(fresh[1][2]) do leases[#leases + 1] = {e[1], 1, e[2]} end
  end
end
if #leases > 0 then redis.call('HINCRBY', KEYS[3], 'claimed', #leases) end
if reclaimed > 0 then redis.call('HINCRBY', KEYS[3], 'reclaims', reclaimed) end
if dead > 0 then
  redis.call('HINCRBY', KEYS[3], 'dead_letters', dead)
  redis.call('HINCRBY', KEYS[3], 'max_attempts_exceeded', dead)
end
return {1, leases, want}
"""

# KEYS: prompts. ARGV: consumer group, worker id, (entry id, attempt)...  -> entry ids still held.
# XCLAIM ... JUSTID resets the idle time without counting a delivery; only the current holder
# of the current attempt may extend, so a worker whose lease was reclaimed cannot steal it back.
HEARTBEAT = """
local held = {}
for i = 3, #ARGV, 2 do
  local id, attempt = ARGV[i], tonumber(ARGV[i + 1])
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)[1]
  if p and p[2] == ARGV[2] and p[4] == attempt then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    held[#held + 1] = id
  end
end
return held
"""

# KEYS: prompts, stats. ARGV: consumer group, worker id, entry id, attempt, lease ttl ms -> 1 | 0.
# Hands the entry to a placeholder consumer, already idle for a full TTL so the next claim takes
# it, and puts the delivery count back so a give-back does not use up an attempt.
RELEASE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1]
if not p or p[2] ~= ARGV[2] or p[4] ~= tonumber(ARGV[4]) then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], '~released', 0, ARGV[3], 'IDLE', ARGV[5],
  'RETRYCOUNT', tonumber(ARGV[4]) - 1, 'JUSTID')
redis.call('HINCRBY', KEYS[2], 'released', 1)
return 1
"""

# KEYS: prompts, completed, trajectories, stats.
# ARGV: consumer group, worker id, entry id, attempt, group id, trajectory JSON.
# -> 1 counted, 0 group already completed (duplicate), -1 entry no longer leased (dead-lettered).
# First finisher wins: any attempt whose entry is still pending may complete, the current one or
# one whose lease was reclaimed; the `completed` hash makes every later completion a duplicate.
COMPLETE = """
if redis.call('HEXISTS', KEYS[2], ARGV[5]) == 1 then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('XDEL', KEYS[1], ARGV[3])
  redis.call('HINCRBY', KEYS[4], 'duplicates', 1)
  return 0
end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1]
if not p then
  redis.call('HINCRBY', KEYS[4], 'rejected', 1)
  return -1
end
redis.call('HSET', KEYS[2], ARGV[5], ARGV[4] .. ' ' .. ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[3], '*', 'trajectory', ARGV[6])
redis.call('HINCRBY', KEYS[4], 'completions', 1)
if p[2] ~= ARGV[2] or p[4] ~= tonumber(ARGV[4]) then
  redis.call('HINCRBY', KEYS[4], 'late_completions', 1)
end
return 1
"""

# KEYS: prompts, dead, stats. ARGV: consumer group, worker id, entry id, attempt, reason,
# payload, counter name.  -> 1 dead-lettered, 0 lease not held by this attempt.
DEAD_LETTER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1]
if not p or p[2] ~= ARGV[2] or p[4] ~= tonumber(ARGV[4]) then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], '*', 'entry_id', ARGV[3], 'group', ARGV[6], 'attempts', ARGV[4],
  'worker_id', ARGV[2], 'reason', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'dead_letters', 1)
redis.call('HINCRBY', KEYS[3], ARGV[7], 1)
return 1
"""
