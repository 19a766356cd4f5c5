--
-- not_null.sql: a table whose NOT NULL constraints were changed is refused
-- with 55000, naming the column and how to restore it, by every function
-- that reads keys, even once a NULL is stored in the column; nothing is
-- read from it and nothing written (the server never crashes on a NULL).
-- scope and key are the primary key's columns: PostgreSQL itself keeps
-- their NOT NULL.
--
\set VERBOSITY default

SELECT outcome FROM idempotency.idem_claim('nn1', '{"a": 1}', scope => 'not-null');
SELECT idempotency.idem_finish('nn2', c.token, 200, '{"ok": true}', 'not-null') IS NOT NULL AS finished
  FROM idempotency.idem_claim('nn2', scope => 'not-null') c;

-- the call of each function on the damaged table, as "SQLSTATE: message"
CREATE FUNCTION pg_temp.try(p_sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	st text; msg text; hint text;
BEGIN
	EXECUTE p_sql;
	RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS st = RETURNED_SQLSTATE, msg = MESSAGE_TEXT, hint = PG_EXCEPTION_HINT;
	RETURN st || ': ' || msg || ' / ' || hint;
END $$;

CREATE TABLE nn_results (col text, call text, result text);
CREATE TABLE nn_before AS SELECT * FROM idempotency.keys WHERE scope = 'not-null';

DO $$
DECLARE
	col text;
	call text;
	res text;
	calls text[] := ARRAY[
		$c$SELECT * FROM idempotency.idem_claim('nn1', '{"a": 1}', scope => 'not-null')$c$,
		$c$SELECT * FROM idempotency.idem_claim('nn-new', scope => 'not-null')$c$,
		$c$SELECT * FROM idempotency.idem_lookup('nn2', 'not-null')$c$,
		$c$SELECT idempotency.idem_finish('nn1', 1, 200, NULL, 'not-null')$c$,
		$c$SELECT * FROM idempotency.idem_sweep()$c$];
BEGIN
	FOREACH col IN ARRAY ARRAY['status', 'attempt', 'created_at', 'expires_at',
	                           'retention', 'sweep_at'] LOOP
		FOREACH call IN ARRAY calls LOOP
			BEGIN
				EXECUTE format('ALTER TABLE idempotency.keys ALTER COLUMN %I DROP NOT NULL', col);
				EXECUTE format($u$UPDATE idempotency.keys SET %I = NULL
				                  WHERE scope = 'not-null' AND key IN ('nn1', 'nn2')$u$, col);
				res := pg_temp.try(call);
				RAISE EXCEPTION USING ERRCODE = 'P0004';	-- undo the damage
			EXCEPTION WHEN assert_failure THEN
				INSERT INTO nn_results VALUES (col, split_part(call, '(', 1), res);
			END;
		END LOOP;
	END LOOP;
END $$;
SELECT col, regexp_replace(call, '^SELECT (\* FROM )?idempotency\.', '') AS call, result
  FROM nn_results ORDER BY col, call;

-- the primary key's columns keep their NOT NULL
ALTER TABLE idempotency.keys ALTER COLUMN scope DROP NOT NULL;
ALTER TABLE idempotency.keys ALTER COLUMN key DROP NOT NULL;

-- the table is whole again and the keys as they were
SELECT count(*) AS changed FROM (
	SELECT * FROM nn_before EXCEPT
	SELECT * FROM idempotency.keys WHERE scope = 'not-null') d;
SELECT outcome, status, response_code FROM idempotency.idem_claim('nn2', scope => 'not-null');
DROP TABLE nn_results, nn_before;
DELETE FROM idempotency.keys WHERE scope = 'not-null';
