--
-- sweep_errors.sql: an error raised inside the sweep's statement path (a
-- user's trigger on idempotency.keys that refuses a delete) ends the
-- sweep's internal subtransaction before it reaches the caller.  The
-- caller's exception handler then goes on in the same transaction, what it
-- writes commits, an interactive ROLLBACK after the failed sweep works,
-- and the refused key is still stored.
--
-- The sweep counts are exact only while nobody else sweeps this database:
-- run with the background sweeper off (idempotency.sweep_interval = 0).
--
\set VERBOSITY sqlstate

SELECT count(*) AS calls FROM idempotency.idem_sweep(NULL);

CREATE TABLE se_log (n int, note text);
CREATE FUNCTION se_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'refused by an audit trigger'; END $$;

-- one key past its retention: claimed, finished with a 1 ms retention,
-- then waited for until its expiry is in the past
SELECT idempotency.idem_finish('e1', c.token, 200, '{"n": 1}', 'sweep-errors',
       retention => '1 millisecond') IS NOT NULL AS finished
  FROM idempotency.idem_claim('e1', scope => 'sweep-errors') c;
SELECT count(*) AS waited FROM idempotency.keys k, pg_sleep_until(k.expires_at)
 WHERE k.scope = 'sweep-errors' AND k.key = 'e1';

CREATE TRIGGER se_refuse BEFORE DELETE ON idempotency.keys
	FOR EACH ROW EXECUTE FUNCTION se_refuse();

-- REPEATABLE READ puts the sweep's statement in a subtransaction; the
-- handler catches the trigger's error and the INSERT after it commits
BEGIN ISOLATION LEVEL REPEATABLE READ;
DO $$
BEGIN
	BEGIN
		PERFORM * FROM idempotency.idem_sweep();
		INSERT INTO se_log VALUES (0, 'the sweep did not fail');
	EXCEPTION WHEN raise_exception THEN
		INSERT INTO se_log VALUES (1, 'caught: ' || SQLERRM);
	END;
	INSERT INTO se_log VALUES (2, 'after the handler');
END $$;
COMMIT;
-- a new transaction sees both rows: the block's transaction ended
SELECT n, note FROM se_log ORDER BY n;
SELECT count(*) AS open_xacts FROM pg_stat_activity
 WHERE pid = pg_backend_pid() AND backend_xid IS NOT NULL;

-- the same under SERIALIZABLE, caught in a savepoint of the caller's
BEGIN ISOLATION LEVEL SERIALIZABLE;
SAVEPOINT before_sweep;
SELECT * FROM idempotency.idem_sweep();
ROLLBACK TO SAVEPOINT before_sweep;
INSERT INTO se_log VALUES (3, 'after the savepoint');
COMMIT;
SELECT n, note FROM se_log WHERE n = 3;

-- interactively: the failed sweep, then ROLLBACK, then the session goes on
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT * FROM idempotency.idem_sweep();
ROLLBACK;
SELECT 'the session goes on' AS status;

-- the refused key is stored as it was
SELECT key, status, response_code, response_body, token IS NOT NULL AS has_token
  FROM idempotency.keys WHERE scope = 'sweep-errors';

-- without the trigger the same sweep deletes it
DROP TRIGGER se_refuse ON idempotency.keys;
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT * FROM idempotency.idem_sweep();
COMMIT;
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'sweep-errors';

DROP TABLE se_log;
DROP FUNCTION se_refuse();
