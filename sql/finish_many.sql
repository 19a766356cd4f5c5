--
-- finish_many.sql: idem_finish_many finishes every key of the batch as
-- idem_finish would, one row per element in array order (ord, key,
-- expires_at), storing each element's code and body (a NULL element: none)
-- under one status and retention; repeated with the same tokens it changes
-- nothing and answers the same expiries.  It is all or nothing: the first
-- element idem_finish would refuse raises that error, its message prefixed
-- with the element's position and key, and no key of the batch is finished.
-- Bad input raises its own SQLSTATE before any key is touched; an empty
-- batch answers nothing; 10,000 keys work with default settings.
--
\set VERBOSITY default
-- the element is named in the message, where every edition puts it; a
-- CONTEXT line says which functions ran, which differs between editions
\set SHOW_CONTEXT never
CREATE TEMP TABLE c (batch text, ord int, key text, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, PRIMARY KEY (batch, ord));
-- Every column but sweep_at: the background worker may reschedule a key
-- taken over at any moment (that bookkeeping is no change a caller sees).
CREATE TEMP VIEW fm_state AS
SELECT count(*) AS rows,
       md5(coalesce(string_agg((k.scope, k.key, k.status, k.token, k.attempt,
           k.fingerprint, k.response_code, k.response_body, k.created_at,
           k.finished_at, k.lease_until, k.expires_at, k.retention, k.phase,
           k.phase_data, k.owner_session)::text, '|' ORDER BY k.key), '')) AS sum
  FROM idempotency.keys k WHERE k.scope = 'finish_many';
CREATE TEMP VIEW fm AS
SELECT key, status, attempt, response_code, response_body FROM idempotency.keys
 WHERE scope = 'finish_many';
-- one row, also where the stats view has none for this database (the
-- counters are NULL where the SQL edition runs, and \gset keeps no NULL)
CREATE TEMP VIEW counters AS
SELECT (SELECT finishes FROM idempotency.stats
         WHERE database = current_database()) AS finishes;
-- Runs "q" and answers the error it raised: SQLSTATE and message (with the
-- token number, which differs between runs, masked).
CREATE FUNCTION pg_temp.err(q text, OUT code text, OUT message text)
LANGUAGE plpgsql AS $$
BEGIN
	EXECUTE q;
EXCEPTION WHEN OTHERS THEN
	GET STACKED DIAGNOSTICS code = RETURNED_SQLSTATE, message = MESSAGE_TEXT;
	message := regexp_replace(message, 'token -?[0-9]+', 'token N');
END
$$;
-- Waits until the wall clock passes "t" (a lease).
CREATE FUNCTION pg_temp.wait_past(t timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
	WHILE clock_timestamp() <= t LOOP
		PERFORM pg_sleep(0.005);
	END LOOP;
	RETURN true;
END
$$;

--
-- A batch finishes all its keys: each element's code and body (NULL
-- elements store none; a JSON null is a body), one expiry per row, as
-- stored.
--
INSERT INTO c SELECT 'a', * FROM idempotency.idem_claim_many(ARRAY['a1', 'a2', 'a3', 'a4'],
       scope => 'finish_many', retention => '2 days');
SELECT key, status FROM fm ORDER BY key;
SELECT coalesce(finishes, 0) AS finishes FROM counters \gset c0_
CREATE TEMP TABLE fa AS
SELECT * FROM idempotency.idem_finish_many(
       ARRAY['a3', 'a1', 'a2', 'a4'],
       (SELECT ARRAY[t3, t1, t2, t4] FROM
          (SELECT max(token) FILTER (WHERE key = 'a1') AS t1, max(token) FILTER (WHERE key = 'a2') AS t2,
                  max(token) FILTER (WHERE key = 'a3') AS t3, max(token) FILTER (WHERE key = 'a4') AS t4
             FROM c WHERE batch = 'a') t),
       ARRAY[203, 201, NULL, 204],
       ARRAY['{"n": 3}', NULL, '{"n": 2}', 'null']::jsonb[],
       'finish_many');
SELECT finishes - :c0_finishes AS finishes FROM counters;
SELECT ord, key FROM fa ORDER BY ord;
SELECT k.key, k.status, k.response_code, k.response_body,
       k.response_body IS NULL AS sql_null, k.owner_session, k.lease_until,
       k.expires_at = fa.expires_at AS expiry_stored,
       k.expires_at - k.finished_at AS kept_for
  FROM idempotency.keys k JOIN fa ON fa.key = k.key
 WHERE k.scope = 'finish_many' ORDER BY k.key;
-- replays answer what was stored
SELECT ord, key, outcome, status, response_code, response_body
  FROM idempotency.idem_claim_many(ARRAY['a1', 'a2', 'a3', 'a4'], scope => 'finish_many');

-- Repeated with the same tokens: the same expiries, nothing changes, no
-- finish counted.  A body or code given on the repeat is not stored.
SELECT sum AS sum0 FROM fm_state \gset
SELECT f.ord, f.key, f.expires_at = fa.expires_at AS same_expiry
  FROM idempotency.idem_finish_many(
       ARRAY['a1', 'a4'],
       (SELECT array_agg(token ORDER BY key) FROM c WHERE batch = 'a' AND key IN ('a1', 'a4')),
       ARRAY[500, 500], ARRAY['{"other": 1}', '{"other": 4}']::jsonb[],
       'finish_many', 'failed') f
  JOIN fa ON fa.key = f.key ORDER BY f.ord;
SELECT sum = :'sum0' AS unchanged FROM fm_state;
SELECT finishes - :c0_finishes AS finishes FROM counters;

-- A key twice in a batch with its token: the second element is a repeat.
INSERT INTO c SELECT 'b', * FROM idempotency.idem_claim_many(ARRAY['b1'], scope => 'finish_many');
SELECT count(*) AS rows, count(DISTINCT expires_at) AS expiries
  FROM idempotency.idem_finish_many(ARRAY['b1', 'b1'],
       (SELECT ARRAY[token, token] FROM c WHERE batch = 'b'), scope => 'finish_many');

--
-- status 'failed' and a retention for the whole batch; the default
-- retention is each claim's.
--
INSERT INTO c SELECT 'f', * FROM idempotency.idem_claim_many(ARRAY['f1', 'f2'],
       scope => 'finish_many', retention => '1 hour');
INSERT INTO c SELECT 'g', * FROM idempotency.idem_claim_many(ARRAY['g1'],
       scope => 'finish_many', retention => '3 days');
CREATE TEMP TABLE ff AS
SELECT * FROM idempotency.idem_finish_many(
       ARRAY['f1', 'f2'], (SELECT array_agg(token ORDER BY ord) FROM c WHERE batch = 'f'),
       ARRAY[422, 409], NULL, 'finish_many', 'failed', '10 minutes');
CREATE TEMP TABLE fg AS
SELECT * FROM idempotency.idem_finish_many(
       ARRAY['g1'], (SELECT array_agg(token) FROM c WHERE batch = 'g'),
       scope => 'finish_many');
SELECT f.ord, f.key, k.status, k.response_code, k.response_body,
       k.expires_at = f.expires_at AS expiry_stored, k.expires_at - k.finished_at AS kept_for
  FROM (SELECT * FROM ff UNION ALL SELECT * FROM fg) f
  JOIN idempotency.keys k ON k.scope = 'finish_many' AND k.key = f.key
 ORDER BY f.key;

--
-- All or nothing.  p1..p4 are pending; p3 was taken over, so the token of
-- its first attempt is stale; x1 is finished.  A refused element raises
-- idem_finish's error with the element in the CONTEXT, and p1, p2 (before
-- it in the batch) stay pending.
--
INSERT INTO c SELECT 'p', * FROM idempotency.idem_claim_many(ARRAY['p1', 'p2', 'p3', 'p4'],
       scope => 'finish_many');
SELECT idempotency.idem_extend('p3', token, '1 ms', 'finish_many') IS NOT NULL AS extended
  FROM c WHERE batch = 'p' AND key = 'p3';
SELECT pg_temp.wait_past(lease_until) FROM idempotency.keys WHERE scope = 'finish_many' AND key = 'p3';
INSERT INTO c SELECT 'p-takeover', * FROM idempotency.idem_claim_many(ARRAY['p3'], scope => 'finish_many');
SELECT ord, key, outcome, attempt FROM c WHERE batch = 'p-takeover';
INSERT INTO c SELECT 'x', * FROM idempotency.idem_claim_many(ARRAY['x1'], scope => 'finish_many');
SELECT count(*) AS finished FROM idempotency.idem_finish_many(ARRAY['x1'],
       (SELECT array_agg(token) FROM c WHERE batch = 'x'), scope => 'finish_many');
SELECT rows AS rows0, sum AS sum0 FROM fm_state \gset
SELECT coalesce(finishes, 0) AS refused_f0 FROM counters \gset
\set unchanged 'SELECT :''LAST_ERROR_SQLSTATE'' AS sqlstate, sum = :''sum0'' AS unchanged FROM fm_state;'
\set pending 'SELECT key, status, attempt FROM fm WHERE key LIKE ''p_'' ORDER BY key;'
\set tokens '(SELECT array_agg(token ORDER BY ord) FROM c WHERE batch = ''p'')'

-- the stale token of p3 (55006; the message names it, masked here)
SELECT * FROM pg_temp.err($$
	SELECT * FROM idempotency.idem_finish_many(ARRAY['p1', 'p2', 'p3', 'p4'], $$ || :'tokens' || $$,
	       ARRAY[200, 200, 200, 200], scope => 'finish_many')$$);
SELECT sum = :'sum0' AS unchanged FROM fm_state;
:pending
-- a token that never held p3 (55006), as psql shows it
SELECT * FROM idempotency.idem_finish_many(ARRAY['p1', 'p2', 'p3', 'p4'],
       (SELECT array_agg(CASE key WHEN 'p3' THEN -1 ELSE token END ORDER BY ord) FROM c WHERE batch = 'p'),
       scope => 'finish_many');
:unchanged
:pending
-- an absent key (P0002)
SELECT * FROM idempotency.idem_finish_many(ARRAY['p1', 'p2', 'absent', 'p4'], :tokens,
       scope => 'finish_many');
:unchanged
:pending
-- a key finished by another token (55000)
SELECT * FROM idempotency.idem_finish_many(ARRAY['p1', 'p2', 'x1', 'p4'], :tokens,
       scope => 'finish_many');
:unchanged
:pending
-- the same in a transaction: the error aborts it, and nothing is left
BEGIN;
SELECT * FROM idempotency.idem_finish_many(ARRAY['p1', 'p2', 'x1'],
       (SELECT array_agg(token ORDER BY ord) FROM c WHERE batch = 'p' AND ord <= 3),
       scope => 'finish_many');
ROLLBACK;
:unchanged
-- a refused batch finished nothing, and counted no finish
SELECT finishes - :refused_f0 AS finishes_counted FROM counters;
-- after the refused batches, the right one finishes them all
SELECT ord, key FROM idempotency.idem_finish_many(ARRAY['p1', 'p2', 'p3', 'p4'],
       (SELECT array_agg(CASE key WHEN 'p3' THEN (SELECT token FROM c WHERE batch = 'p-takeover')
                                   ELSE token END ORDER BY ord)
          FROM c WHERE batch = 'p'),
       scope => 'finish_many');
SELECT key, status, attempt FROM fm WHERE key LIKE 'p_' ORDER BY key;
SELECT sum AS sum0 FROM fm_state \gset

--
-- Bad input: its own SQLSTATE, checked before any key is touched (so the
-- good elements before it finish nothing either), no CONTEXT, and the
-- table unchanged.  q1, q2 are pending.
--
INSERT INTO c SELECT 'q', * FROM idempotency.idem_claim_many(ARRAY['q1', 'q2'], scope => 'finish_many');
SELECT rows AS rows0, sum AS sum0 FROM fm_state \gset
SELECT coalesce(finishes, 0) AS finishes FROM counters \gset c0_
\set tokens '(SELECT array_agg(token ORDER BY ord) FROM c WHERE batch = ''q'')'
-- arrays of another length than keys: 22023
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'],
       (SELECT array_agg(token) FROM c WHERE batch = 'q' AND key = 'q1'), scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens || 1::bigint, scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, ARRAY[200],
       scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, '{}',
       scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, NULL,
       ARRAY['{}', '{}', '{}']::jsonb[], 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many('{}', '{1}', scope => 'finish_many');
:unchanged
-- NULL keys or tokens, a NULL element of either: 22004
SELECT * FROM idempotency.idem_finish_many(NULL, :tokens, scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], NULL, scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', NULL], :tokens, scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2', 'q3'],
       :tokens || NULL::bigint, scope => 'finish_many');
:unchanged
-- an empty key: 22023; a key over 255 characters: 22001
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', ''], :tokens, scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', repeat('k', 256)], :tokens, scope => 'finish_many');
:unchanged
-- arrays of more than one dimension: 22023
SELECT * FROM idempotency.idem_finish_many(ARRAY[['q1', 'q2']], :tokens, scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], ARRAY[:tokens], scope => 'finish_many');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, ARRAY[[200], [200]],
       scope => 'finish_many');
:unchanged
-- a body over idempotency.max_response_size: 54000, named by position
SET idempotency.max_response_size = 100;
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, NULL,
       ARRAY['{"small": 1}', jsonb_build_object('big', repeat('x', 200))], 'finish_many');
:unchanged
RESET idempotency.max_response_size;
-- NULL scope or status: 22004; a scope over 255 characters: 22001
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, scope => NULL);
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, scope => repeat('s', 256));
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, scope => 'finish_many',
       status => NULL);
:unchanged
-- an unknown status: 22023
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, scope => 'finish_many',
       status => 'pending');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, scope => 'finish_many',
       status => 'ok');
:unchanged
-- retention not positive: 22023
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, scope => 'finish_many',
       retention => '0');
:unchanged
SELECT * FROM idempotency.idem_finish_many(ARRAY['q1', 'q2'], :tokens, scope => 'finish_many',
       retention => '-1 hour');
:unchanged
SELECT rows = :rows0 AS same_rows, sum = :'sum0' AS unchanged FROM fm_state;
-- bad input counts no finish
SELECT finishes - :c0_finishes AS finishes FROM counters;

-- Empty arrays: no rows, nothing finished.
SELECT count(*) AS rows FROM idempotency.idem_finish_many('{}', '{}', scope => 'finish_many');
SELECT count(*) AS rows FROM idempotency.idem_finish_many('{}', '{}', '{}', '{}', 'finish_many');
SELECT rows = :rows0 AS same_rows, sum = :'sum0' AS unchanged FROM fm_state;

DELETE FROM idempotency.keys WHERE scope = 'finish_many';

--
-- 10,000 keys in one batch, with default settings; repeated: the same
-- expiries.
--
INSERT INTO c SELECT 'm', * FROM idempotency.idem_claim_many(
       ARRAY(SELECT 'm' || g FROM generate_series(1, 10000) g), scope => 'finish_many');
SELECT outcome, count(*) AS keys FROM c WHERE batch = 'm' GROUP BY outcome;
BEGIN;
CREATE TEMP TABLE fm10k AS
SELECT * FROM idempotency.idem_finish_many(
       (SELECT array_agg(key ORDER BY ord) FROM c WHERE batch = 'm'),
       (SELECT array_agg(token ORDER BY ord) FROM c WHERE batch = 'm'),
       (SELECT array_agg(ord ORDER BY ord) FROM c WHERE batch = 'm'),
       (SELECT array_agg(jsonb_build_object('ord', ord) ORDER BY ord) FROM c WHERE batch = 'm'),
       'finish_many');
SELECT count(*) AS advisory_locks FROM pg_locks
 WHERE pid = pg_backend_pid() AND locktype = 'advisory';
SELECT count(*) < 100 AS few_locks FROM pg_locks WHERE pid = pg_backend_pid();
COMMIT;
SELECT count(*) AS rows, count(*) FILTER (WHERE key = 'm' || ord) AS in_order FROM fm10k;
SELECT k.status, count(*) AS keys,
       count(*) FILTER (WHERE k.expires_at = f.expires_at) AS expiry_stored,
       count(*) FILTER (WHERE k.response_code = f.ord
                          AND k.response_body = jsonb_build_object('ord', f.ord)) AS right_result
  FROM idempotency.keys k JOIN fm10k f ON f.key = k.key
 WHERE k.scope = 'finish_many' GROUP BY k.status;
SELECT count(*) AS rows, count(*) FILTER (WHERE f.expires_at = f0.expires_at) AS same_expiry
  FROM idempotency.idem_finish_many(
       (SELECT array_agg(key ORDER BY ord) FROM c WHERE batch = 'm'),
       (SELECT array_agg(token ORDER BY ord) FROM c WHERE batch = 'm'),
       scope => 'finish_many') f
  JOIN fm10k f0 ON f0.ord = f.ord;

DELETE FROM idempotency.keys WHERE scope = 'finish_many';
