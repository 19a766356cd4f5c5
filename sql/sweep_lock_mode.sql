--
-- sweep_lock_mode.sql: the sweep locks a row it resets or reschedules in
-- the mode of its update, FOR NO KEY UPDATE (no sweep write changes scope
-- or key).  With FOR UPDATE, the update takes the stronger of the two
-- modes and is recorded as changing the key (HEAP_KEYS_UPDATED on the
-- replaced version), which a FOR KEY SHARE lock, such as a foreign key's
-- check, has to wait for.  Read from the replaced row version, in the
-- sweeping transaction: its xmax is a plain transaction id.
-- Both ways of writing: straight to the table, and through the statement
-- (a trigger on it).
--
\set VERBOSITY sqlstate
CREATE EXTENSION IF NOT EXISTS pageinspect;

-- the replaced version of the row at "tid": was it updated as a change of
-- its key, is its xmax a MultiXact, and has it an updater at all?
CREATE FUNCTION pg_temp.old_version(tid tid)
RETURNS TABLE (keys_updated boolean, multi boolean, replaced boolean)
LANGUAGE sql AS $$
	SELECT (t_infomask2 & 8192) <> 0, (t_infomask & 4096) <> 0,
	       t_xmax::text <> '0'
	  FROM heap_page_items(get_raw_page('idempotency.keys',
	                                    (tid::text::point)[0]::int))
	 WHERE lp = (tid::text::point)[1]::int
$$;

-- a key whose lease ended: the sweep resets it
SELECT outcome FROM idempotency.idem_claim('l1', scope => 'sweep-lock', lease => '1 millisecond');
SELECT ctid AS l1_tid FROM idempotency.keys WHERE scope = 'sweep-lock' AND key = 'l1' \gset
SELECT pg_sleep(0.01);
BEGIN;
SELECT reset FROM idempotency.idem_sweep();
SELECT * FROM pg_temp.old_version(:'l1_tid');
SELECT token IS NULL AS reset FROM idempotency.keys WHERE scope = 'sweep-lock' AND key = 'l1';
COMMIT;

-- through the statement: a trigger on the table
CREATE FUNCTION public.sweep_lock_noop() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RETURN NULL; END $$;
SELECT outcome FROM idempotency.idem_claim('l2', scope => 'sweep-lock', lease => '1 millisecond');
SELECT ctid AS l2_tid FROM idempotency.keys WHERE scope = 'sweep-lock' AND key = 'l2' \gset
SELECT pg_sleep(0.01);
BEGIN;
CREATE TRIGGER sweep_lock_noop AFTER UPDATE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION public.sweep_lock_noop();
SELECT reset FROM idempotency.idem_sweep();
SELECT * FROM pg_temp.old_version(:'l2_tid');
SELECT token IS NULL AS reset FROM idempotency.keys WHERE scope = 'sweep-lock' AND key = 'l2';
ROLLBACK;

-- with a unique index on token (one a foreign key can reference), a reset
-- changes a column of the row's key: the sweep locks it FOR UPDATE, the
-- mode of that update, which then has nothing to strengthen
SELECT outcome FROM idempotency.idem_claim('l3', scope => 'sweep-lock', lease => '1 millisecond');
SELECT ctid AS l3_tid FROM idempotency.keys WHERE scope = 'sweep-lock' AND key = 'l3' \gset
SELECT pg_sleep(0.01);
BEGIN;
CREATE UNIQUE INDEX keys_token_idx ON idempotency.keys (token);
SELECT reset FROM idempotency.idem_sweep();
SELECT * FROM pg_temp.old_version(:'l3_tid');
SELECT token IS NULL AS reset FROM idempotency.keys WHERE scope = 'sweep-lock' AND key = 'l3';
ROLLBACK;

DROP FUNCTION public.sweep_lock_noop();
DELETE FROM idempotency.keys WHERE scope = 'sweep-lock';
DROP EXTENSION pageinspect;
