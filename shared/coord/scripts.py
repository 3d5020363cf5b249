"""Lua scripts: every state change that must be atomic runs as one script on the server.

Layout of a prompt-stream entry: one field `group` holding the PromptGroup JSON. An entry leaves
the stream (XACK + XDEL together) only when it is completed or dead-lettered, so
XLEN(prompts) = groups queued + groups leased, which is what the queue bound limits.
Why each check exists is explained in docs/coordination.md.
"""

from __future__ import annotations

# KEYS: prompts, stats. ARGV: max_queue, (group id, payload)...  -> {1, entry ids} or {0, depth}
# The group id rides beside the payload so RECONCILE can find a group without parsing JSON.
ENQUEUE = """
local n = (#ARGV - 1) / 2
local depth = redis.call('XLEN', KEYS[1])
if depth + n > tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[2], 'refused', n)
  return {0, depth}
end
local ids = {}
for i = 2, #ARGV, 2 do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'group', ARGV[i + 1], 'id', ARGV[i])
end
redis.call('HINCRBY', KEYS[2], 'enqueued', n)
return {1, ids}
"""

# KEYS: prompts, dead, stats, worker hash, trainer version, reclaim cursor, trajectories, in-flight limit.
# ARGV: consumer group, worker id, count, lease ttl ms, max attempts, staleness bound.
# -> {0} when the worker lags, or when the in-flight window is full and no lease has expired, else
#    {1, {{entry id, attempt, fields}, ...}, new groups the caller may still take (window room)}.
# Expired leases first (XAUTOCLAIM, attempt = delivery count), then new entries (attempt 1).
# In-flight window: groups leased plus trajectories the trainer has not read yet stay within the
# limit the trainer sets, so rollouts never run further ahead than the trainer can consume within
# max_lag versions (docs/coordination.md). Expired leases are reclaimed before the window is
# applied: they already count in it, so a dead worker's leases filling the window would otherwise
# block every claim, and with it their own reclaim, forever.
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
      local payload, gid = '', ''
      for i = 1, #e[2], 2 do
        if e[2][i] == 'group' then payload = e[2][i + 1] end
        if e[2][i] == 'id' then gid = e[2][i + 1] end
      end
      redis.call('XACK', KEYS[1], group, id)
      redis.call('XDEL', KEYS[1], id)
      redis.call('XADD', KEYS[2], '*', 'entry_id', id, 'group', payload, 'group_id', gid, 'attempts',
      attempt - 1,
        'reason', 'max_attempts: ' .. (attempt - 1) .. ' leases expired without completion')
      dead = dead + 1
    else
      leases[#leases + 1] = {id, attempt, e[2]}
      reclaimed = reclaimed + 1
    end
  end
end
local room = want - #leases
local limit = tonumber(redis.call('GET', KEYS[8]) or '0')
if limit > 0 then
  local window = limit - redis.call('XPENDING', KEYS[1], group)[1] - redis.call('XLEN', KEYS[7])
  if window < room then room = window end
end
if room > 0 then
  local fresh = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', room, 'STREAMS', KEYS[1], '>')
  if fresh then
    for _, e in ipairs(fresh[1][2]) do leases[#leases + 1] = {e[1], 1, e[2]} end
  end
end
if reclaimed > 0 then redis.call('HINCRBY', KEYS[3], 'reclaims', reclaimed) end
if dead > 0 then
  redis.call('HINCRBY', KEYS[3], 'dead_letters', dead)
  redis.call('HINCRBY', KEYS[3], 'max_attempts_exceeded', dead)
end
if #leases == 0 and room <= 0 then
  redis.call('HINCRBY', KEYS[3], 'window_refusals', 1)
  return {0}
end
if #leases > 0 then redis.call('HINCRBY', KEYS[3], 'claimed', #leases) end
return {1, leases, math.max(room, 0)}
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
redis.call('XADD', KEYS[3], '*', 'trajectory', ARGV[6], 'group_id', ARGV[5])
redis.call('HINCRBY', KEYS[4], 'completions', 1)
if p[2] ~= ARGV[2] or p[4] ~= tonumber(ARGV[4]) then
  redis.call('HINCRBY', KEYS[4], 'late_completions', 1)
end
return 1
"""

# KEYS: prompts, dead, stats. ARGV: consumer group, worker id, entry id, attempt, reason,
# payload, counter name, group id.  -> 1 dead-lettered, 0 lease not held by this attempt.
DEAD_LETTER = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1]
if not p or p[2] ~= ARGV[2] or p[4] ~= tonumber(ARGV[4]) then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], '*', 'entry_id', ARGV[3], 'group', ARGV[6], 'group_id', ARGV[8], 'attempts',
ARGV[4],
  'worker_id', ARGV[2], 'reason', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'dead_letters', 1)
redis.call('HINCRBY', KEYS[3], ARGV[7], 1)
return 1
"""

# KEYS: prompts, dead, stats, failures. ARGV: consumer group, worker id, entry id, attempt,
# group id, error, max attempts, lease ttl ms, payload.
# -> 1 back in the queue, 2 dead-lettered (this was its last attempt), 0 lease not held.
# Processing this group failed (e.g. its reward function raised). Unlike RELEASE the attempt stays
# used: the entry goes to the placeholder consumer already idle for a full TTL with its delivery
# count kept, so the next claim takes it at once as attempt + 1, and after max_attempts failures it
# is dead-lettered with the last error instead of circulating forever.
FAIL = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)[1]
if not p or p[2] ~= ARGV[2] or p[4] ~= tonumber(ARGV[4]) then return 0 end
local attempt = tonumber(ARGV[4])
redis.call('HSET', KEYS[4], ARGV[5], attempt .. ' ' .. ARGV[2] .. ': ' .. ARGV[6])
redis.call('HINCRBY', KEYS[3], 'failures', 1)
if attempt >= tonumber(ARGV[7]) then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('XDEL', KEYS[1], ARGV[3])
  redis.call('XADD', KEYS[2], '*', 'entry_id', ARGV[3], 'group', ARGV[9], 'group_id', ARGV[5],
    'attempts', attempt, 'worker_id', ARGV[2],
    'reason', 'failed: ' .. attempt .. ' attempts; last error: ' .. ARGV[6])
  redis.call('HINCRBY', KEYS[3], 'dead_letters', 1)
  redis.call('HINCRBY', KEYS[3], 'failed_groups', 1)
  return 2
end
redis.call('XCLAIM', KEYS[1], ARGV[1], '~released', 0, ARGV[3], 'IDLE', ARGV[8], 'RETRYCOUNT', attempt,
'JUSTID')
return 1
"""

# Group ids of every entry in the prompt, trajectory and dead-letter streams (a Lua helper).
_PRESENT = """
local present, dead = {}, {}
for s = 1, 3 do
  for _, e in ipairs(redis.call('XRANGE', KEYS[s], '-', '+')) do
    for i = 1, #e[2], 2 do
      if e[2][i] == 'id' or e[2][i] == 'group_id' then
        present[e[2][i + 1]] = true
        if s == 3 then dead[e[2][i + 1]] = true end
      end
    end
  end
end
"""

# KEYS: prompts, trajectories, dead. ARGV: group ids.  -> {ids in none of the streams, ids dead-lettered}.
# Read-only and atomic, so no group is seen "in flight" between two streams.
MISSING = _PRESENT + """
local missing, dead_ids = {}, {}
for _, id in ipairs(ARGV) do
  if dead[id] then dead_ids[#dead_ids + 1] = id
  elseif not present[id] then missing[#missing + 1] = id end
end
return {missing, dead_ids}
"""

# KEYS: prompts, trajectories, dead, completed, stats. ARGV: (group id, payload)...  -> ids queued.
# Re-enqueues groups that are in no stream (lost with Redis data, or completed but dropped as
# stale): checked again here, atomically, and their `completed` mark cleared so the new copy can
# be counted. The queue bound is not applied: these groups were admitted once already.
REQUEUE = _PRESENT + """
local queued = {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  if not present[id] then
    redis.call('HDEL', KEYS[4], id)
    redis.call('XADD', KEYS[1], '*', 'group', ARGV[i + 1], 'id', id)
    present[id] = true
    queued[#queued + 1] = id
  end
end
if #queued > 0 then redis.call('HINCRBY', KEYS[5], 'requeued', #queued) end
return queued
"""

# KEYS: epoch. ARGV: token.  -> 1 the key holds the token, 0 it was missing (now set), -1 it holds
# another token (returned second). A missing key means Redis lost the run's data.
EPOCH = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1])
  return {0, ARGV[1]}
end
if cur == ARGV[1] then return {1, cur} end
return {-1, cur}
"""
