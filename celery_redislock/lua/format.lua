-- format.lua: check (and on first use record) the data-format version of a
-- namespace, so that processes of two releases whose lock data differ in
-- shape never share it.
--
-- KEYS: 1 {ns}:format  the namespace's data-format version (string)
--       2 {ns}:fence   the fencing counter: present once anything was acquired
-- ARGV: 1 this release's format version (a decimal string)
--       2 the format that data written before versioning has (a decimal
--         string): a namespace with a fence and no format key holds it
--
-- Atomic steps: GET the format key; if it is set, reply with it (nothing
-- written). Otherwise, if the fence exists (data of a release from before
-- format versioning) and ARGV[2] differs from ARGV[1], reply with ARGV[2]
-- and write nothing (the caller refuses the namespace). Otherwise SET the
-- format key to ARGV[1] with NX (a brand-new namespace, a Redis that lost
-- its data, or unversioned data of this very format) and reply with it.
-- Reply: {format, how}: how = 'stored' (read from the key), 'unversioned'
-- (inferred from the fence, not written) or 'created' (written now).

local stored = redis.call('GET', KEYS[1])
if stored then
  return {stored, 'stored'}
end
if ARGV[2] ~= ARGV[1] and redis.call('EXISTS', KEYS[2]) == 1 then
  return {ARGV[2], 'unversioned'}
end
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return {ARGV[1], 'created'}
