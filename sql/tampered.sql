--
-- tampered.sql: rows and tables changed behind the functions' back (by a
-- superuser, with plain SQL) are refused with a clear error and a SQLSTATE,
-- never read as something else, and everything works again once the change
-- is undone.  Each change is made in a transaction that rolls back.
--
-- The SQLSTATE and message of the error "q" raises ('ok' if none).
CREATE FUNCTION pg_temp.err(q text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	EXECUTE q;
	RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
	RETURN SQLSTATE || ': ' || SQLERRM;
END $$;

SELECT outcome, attempt FROM idempotency.idem_claim('t1', '{"v": 1}', 'tampered');

-- an unknown status: not read as "failed"
BEGIN;
UPDATE idempotency.keys SET status = 'done' WHERE scope = 'tampered' AND key = 't1';
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t1', '{"v": 1}', 'tampered')$$);
SELECT pg_temp.err($$SELECT idempotency.idem_lookup('t1', 'tampered')$$);
ROLLBACK;

-- a fingerprint that is not 32 bytes
BEGIN;
UPDATE idempotency.keys SET fingerprint = '\x00ff' WHERE scope = 'tampered' AND key = 't1';
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t1', '{"v": 1}', 'tampered')$$);
ROLLBACK;

-- a column added to the keys table
BEGIN;
ALTER TABLE idempotency.keys ADD COLUMN note text;
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t2', scope => 'tampered')$$);
ROLLBACK;

-- a column added to the scope bindings
BEGIN;
ALTER TABLE idempotency.scope_bindings ADD COLUMN note text;
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t2', scope => 'tampered')$$);
ROLLBACK;

-- a scope binding with a NULL prefix (the constraint dropped first)
BEGIN;
ALTER TABLE idempotency.scope_bindings ALTER COLUMN scope_prefix DROP NOT NULL;
INSERT INTO idempotency.scope_bindings VALUES (current_user::regrole, NULL);
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t2', scope => 'tampered')$$);
ROLLBACK;

-- the scope bindings table gone (renamed away): no call goes through, as
-- nobody can tell which roles are bound
BEGIN;
ALTER TABLE idempotency.scope_bindings RENAME TO scope_bindings_gone;
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t2', scope => 'tampered')$$);
ROLLBACK;

-- the sweep index replaced by one on another column
BEGIN;
DROP INDEX idempotency.keys_sweep_at_idx;
CREATE INDEX keys_sweep_at_idx ON idempotency.keys (expires_at);
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t2', scope => 'tampered')$$);
ROLLBACK;

-- after the rollbacks every function works again, in the same session
SELECT outcome, attempt FROM idempotency.idem_claim('t2', scope => 'tampered');
SELECT outcome FROM idempotency.idem_claim('t1', '{"v": 1}', 'tampered');
SELECT status, attempt FROM idempotency.idem_lookup('t1', 'tampered');
SELECT idempotency.idem_finish(key, token, 200, scope => 'tampered') IS NOT NULL AS finished
  FROM idempotency.keys WHERE scope = 'tampered' ORDER BY key;
SELECT key, status, attempt FROM idempotency.keys WHERE scope = 'tampered' ORDER BY key;

-- the same changes to a finished key, whose replay a single read answers:
-- refused all the same, and replayed again once undone
BEGIN;
UPDATE idempotency.keys SET status = 'done' WHERE scope = 'tampered' AND key = 't1';
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t1', '{"v": 1}', 'tampered')$$);
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t1', '{"v": 2}', 'tampered')$$);
ROLLBACK;
BEGIN;
UPDATE idempotency.keys SET fingerprint = '\x00ff' WHERE scope = 'tampered' AND key = 't1';
SELECT pg_temp.err($$SELECT idempotency.idem_claim('t1', '{"v": 1}', 'tampered')$$);
ROLLBACK;
SELECT outcome, status, response_code FROM idempotency.idem_claim('t1', '{"v": 1}', 'tampered');
SELECT outcome, status FROM idempotency.idem_claim('t1', '{"v": 2}', 'tampered');
DELETE FROM idempotency.keys WHERE scope = 'tampered';
