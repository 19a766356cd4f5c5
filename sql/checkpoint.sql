--
-- checkpoint.sql: idem_checkpoint records the current attempt's last step
-- (phase, phase_data); a later checkpoint replaces it; a takeover (even a
-- second one without a new checkpoint) answers it; finish keeps it for
-- idem_lookup; a fresh claim over an expired key and a release forget it;
-- every other claim outcome answers no phase; a rolled-back checkpoint
-- leaves nothing; dead tokens, finished and absent keys and every bad input
-- raise their own SQLSTATE and change nothing; the stats view counts each
-- checkpoint call that succeeded.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
-- Every column but sweep_at: the background worker may reschedule a key
-- at any moment (that bookkeeping is no change a caller could see).
CREATE TEMP VIEW cp_state AS
SELECT count(*) AS rows,
       md5(coalesce(string_agg((k.scope, k.key, k.status, k.token, k.attempt,
           k.fingerprint, k.response_code, k.response_body, k.created_at,
           k.finished_at, k.lease_until, k.expires_at, k.retention, k.phase,
           k.phase_data, k.owner_session)::text, '|' ORDER BY k.key), '')) AS sum
  FROM idempotency.keys k WHERE k.scope = 'checkpoint';
CREATE TEMP VIEW cp AS
SELECT key, status, attempt, phase, phase_data FROM idempotency.keys
 WHERE scope = 'checkpoint';
-- Waits until the wall clock passes "t" (a lease or an expiry).
CREATE FUNCTION pg_temp.wait_past(t timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
	WHILE clock_timestamp() <= t LOOP
		PERFORM pg_sleep(0.005);
	END LOOP;
	RETURN true;
END
$$;
SELECT coalesce(checkpoints, 0) AS cp0 FROM idempotency.stats WHERE database = current_database() \gset

--
-- A checkpoint on a pending key is stored; a later one replaces it.
--
INSERT INTO r SELECT 'a1', * FROM idempotency.idem_claim('order-1', '{"order": 1}', 'checkpoint')
RETURNING step, outcome, attempt, phase, phase_data;
SELECT token AS a1 FROM r WHERE step = 'a1' \gset
SELECT * FROM cp WHERE key = 'order-1';
\set claim_cols 'k.status, k.token, k.attempt, k.fingerprint, k.response_code, k.response_body, k.created_at, k.finished_at, k.lease_until, k.expires_at, k.retention, k.owner_session'
SELECT (:claim_cols)::text AS a1_row FROM idempotency.keys k
 WHERE k.scope = 'checkpoint' AND k.key = 'order-1' \gset
SELECT idempotency.idem_checkpoint('order-1', :a1, 'charge_created', '{"charge": "ch_1"}', 'checkpoint');
SELECT * FROM cp WHERE key = 'order-1';
SELECT idempotency.idem_checkpoint('order-1', :a1, 'label_printed',
       '{"charge": "ch_1", "label": "L9"}', 'checkpoint');
SELECT * FROM cp WHERE key = 'order-1';
-- a checkpoint changes nothing else: same token, attempt, lease, expiry
SELECT (:claim_cols)::text = :'a1_row' AS rest_unchanged FROM idempotency.keys k
 WHERE k.scope = 'checkpoint' AND k.key = 'order-1';
SELECT status, attempt, phase FROM idempotency.idem_lookup('order-1', 'checkpoint');

-- Other outcomes answer no phase: in_progress (live lease), mismatch.
INSERT INTO r SELECT 'a1-live', * FROM idempotency.idem_claim('order-1', '{"order": 1}', 'checkpoint')
RETURNING step, outcome, token, attempt, phase, phase_data;
INSERT INTO r SELECT 'a1-mismatch', * FROM idempotency.idem_claim('order-1', '{"order": 2}', 'checkpoint')
RETURNING step, outcome, token, attempt, phase, phase_data;

--
-- A checkpoint in a transaction that rolls back leaves the earlier one.
--
BEGIN;
SELECT idempotency.idem_checkpoint('order-1', :a1, 'rolled_back', '{"x": 1}', 'checkpoint');
SELECT phase, phase_data FROM cp WHERE key = 'order-1';
SELECT phase FROM idempotency.idem_lookup('order-1', 'checkpoint');
ROLLBACK;
SELECT phase, phase_data FROM cp WHERE key = 'order-1';
-- and so does one rolled back to a savepoint
BEGIN;
SAVEPOINT s;
SELECT idempotency.idem_checkpoint('order-1', :a1, 'rolled_back', NULL, 'checkpoint');
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT phase, phase_data FROM cp WHERE key = 'order-1';

--
-- Takeovers answer the last checkpoint, also a second takeover with no
-- checkpoint in between.  The attempt gets a short lease by an extend.
--
SELECT idempotency.idem_extend('order-1', :a1, '1 ms', 'checkpoint') IS NOT NULL AS extended;
SELECT pg_temp.wait_past(lease_until) FROM idempotency.keys
 WHERE scope = 'checkpoint' AND key = 'order-1';
INSERT INTO r SELECT 'a2', * FROM idempotency.idem_claim('order-1', '{"order": 1}', 'checkpoint',
       lease => '1 ms')
RETURNING step, outcome, token > :a1 AS larger, attempt, phase, phase_data;
SELECT token AS a2 FROM r WHERE step = 'a2' \gset
-- the takeover kept the checkpoint in the table
SELECT * FROM cp WHERE key = 'order-1';
SELECT pg_temp.wait_past(lease_until) FROM idempotency.keys
 WHERE scope = 'checkpoint' AND key = 'order-1';
INSERT INTO r SELECT 'a3', * FROM idempotency.idem_claim('order-1', '{"order": 1}', 'checkpoint')
RETURNING step, outcome, token > :a2 AS larger, attempt, phase, phase_data;
SELECT token AS a3 FROM r WHERE step = 'a3' \gset

-- The dead tokens may not checkpoint (55006); nothing changes.
SELECT sum AS sum0 FROM cp_state \gset
SELECT idempotency.idem_checkpoint('order-1', :a2, 'stale', '{"from": 2}', 'checkpoint');
SELECT idempotency.idem_checkpoint('order-1', :a1, 'stale', '{"from": 1}', 'checkpoint');
SELECT sum = :'sum0' AS unchanged FROM cp_state;

-- The current attempt checkpoints without data: phase_data becomes NULL.
SELECT idempotency.idem_checkpoint('order-1', :a3, 'packed', scope => 'checkpoint');
SELECT * FROM cp WHERE key = 'order-1';

-- Finish keeps the checkpoint: idem_lookup shows its phase; a replay
-- answers no phase; a checkpoint on the finished key raises 55000, also
-- with the token that finished it.
SELECT idempotency.idem_finish('order-1', :a3, 200, '{"shipped": true}', 'checkpoint') IS NOT NULL AS finished;
SELECT * FROM cp WHERE key = 'order-1';
SELECT status, attempt, response_code, phase FROM idempotency.idem_lookup('order-1', 'checkpoint');
INSERT INTO r SELECT 'a-replay', * FROM idempotency.idem_claim('order-1', '{"order": 1}', 'checkpoint')
RETURNING step, outcome, token, status, response_body, phase, phase_data;
SELECT sum AS sum0 FROM cp_state \gset
SELECT idempotency.idem_checkpoint('order-1', :a3, 'late', NULL, 'checkpoint');
SELECT idempotency.idem_checkpoint('order-1', :a1, 'late', NULL, 'checkpoint');
SELECT sum = :'sum0' AS unchanged FROM cp_state;

--
-- A first attempt answers no phase; a takeover of an attempt that
-- recorded no checkpoint answers none either.
--
INSERT INTO r SELECT 'b1', * FROM idempotency.idem_claim('order-2', scope => 'checkpoint', lease => '1 ms')
RETURNING step, outcome, attempt, phase, phase_data;
SELECT pg_temp.wait_past(lease_until) FROM idempotency.keys
 WHERE scope = 'checkpoint' AND key = 'order-2';
INSERT INTO r SELECT 'b2', * FROM idempotency.idem_claim('order-2', scope => 'checkpoint')
RETURNING step, outcome, attempt, phase, phase_data;

--
-- A fresh claim over a key past its retention starts over: attempt 1, no
-- phase, and the stored checkpoint is cleared.  The row lock keeps the
-- background sweeper from deleting the expired row meanwhile, so the claim
-- really rewrites it.
--
SELECT idempotency.idem_checkpoint('order-2', token, 'step_1', '{"n": 1}', 'checkpoint') FROM r WHERE step = 'b2';
SELECT idempotency.idem_finish('order-2', token, 500, NULL, 'checkpoint', 'failed', retention => '1 ms') IS NOT NULL AS finished
  FROM r WHERE step = 'b2';
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'checkpoint' AND key = 'order-2' FOR UPDATE) l;
SELECT pg_temp.wait_past(expires_at) FROM idempotency.keys
 WHERE scope = 'checkpoint' AND key = 'order-2';
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('order-2', 'checkpoint');
INSERT INTO r SELECT 'b-fresh', * FROM idempotency.idem_claim('order-2', scope => 'checkpoint')
RETURNING step, outcome, attempt, phase, phase_data;
SELECT * FROM cp WHERE key = 'order-2';
COMMIT;
SELECT status, attempt, phase FROM idempotency.idem_lookup('order-2', 'checkpoint');

--
-- Release forgets the key and its checkpoint: the next claim is a first
-- attempt with no phase.
--
INSERT INTO r SELECT 'c1', * FROM idempotency.idem_claim('order-3', scope => 'checkpoint')
RETURNING step, outcome, attempt;
SELECT token AS c1 FROM r WHERE step = 'c1' \gset
SELECT idempotency.idem_checkpoint('order-3', :c1, 'reserved', '{"seat": "12A"}', 'checkpoint');
SELECT idempotency.idem_release('order-3', :c1, 'checkpoint');
SELECT count(*) AS rows FROM cp WHERE key = 'order-3';
INSERT INTO r SELECT 'c2', * FROM idempotency.idem_claim('order-3', scope => 'checkpoint')
RETURNING step, outcome, attempt, phase, phase_data;
SELECT * FROM cp WHERE key = 'order-3';
SELECT status, attempt, phase FROM idempotency.idem_lookup('order-3', 'checkpoint');

--
-- Bad input: its own SQLSTATE, checked before the key's state, and the
-- table unchanged.  d1 is a live pending key.
--
INSERT INTO r SELECT 'd1', * FROM idempotency.idem_claim('order-4', scope => 'checkpoint', lease => '1 hour')
RETURNING step, outcome, attempt;
SELECT token AS d1 FROM r WHERE step = 'd1' \gset
SELECT idempotency.idem_checkpoint('order-4', :d1, 'start', '{"v": 0}', 'checkpoint');
SELECT rows, sum AS sum0 FROM cp_state \gset
\set unchanged 'SELECT sum = ' :'sum0' ' AS unchanged FROM cp_state;'
-- NULL key, token, phase, scope: 22004
SELECT idempotency.idem_checkpoint(NULL, :d1, 'p', NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', NULL, 'p', NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', :d1, NULL, NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', :d1, 'p', NULL, NULL);
:unchanged
-- empty key or phase: 22023
SELECT idempotency.idem_checkpoint('', :d1, 'p', NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', :d1, '', NULL, 'checkpoint');
:unchanged
-- key, phase or scope over 255 characters: 22001
SELECT idempotency.idem_checkpoint(repeat('k', 256), :d1, 'p', NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', :d1, repeat('p', 256), NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', :d1, 'p', NULL, repeat('s', 256));
:unchanged
-- data over idempotency.max_response_size: 54000
SET idempotency.max_response_size = 100;
SELECT idempotency.idem_checkpoint('order-4', :d1, 'p',
       jsonb_build_object('big', repeat('x', 200)), 'checkpoint');
:unchanged
-- the bad inputs are checked before the key's state
SELECT idempotency.idem_checkpoint('absent', :d1, NULL, NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-1', :a3, 'p',
       jsonb_build_object('big', repeat('x', 200)), 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('absent', :d1, repeat('p', 256), NULL, 'checkpoint');
:unchanged
-- an absent key: P0002; a token that never held the key: 55006
SELECT idempotency.idem_checkpoint('absent', :d1, 'p', NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', :c1, 'p', NULL, 'checkpoint');
:unchanged
SELECT idempotency.idem_checkpoint('order-4', -1, 'p', NULL, 'checkpoint');
:unchanged
-- the same key in another scope is another key
SELECT idempotency.idem_checkpoint('order-4', :d1, 'p', NULL, 'checkpoint-other');
:unchanged
SELECT rows = :rows AS same_rows, sum = :'sum0' AS unchanged FROM cp_state;
-- the limits themselves are accepted: 255 characters (of any byte width),
-- data within the size limit
SELECT idempotency.idem_checkpoint('order-4', :d1, repeat('é', 255), '{"small": 1}', 'checkpoint');
SELECT length(phase) AS phase_chars, phase_data FROM cp WHERE key = 'order-4';
RESET idempotency.max_response_size;
SELECT idempotency.idem_checkpoint('order-4', :d1, 'big_data',
       jsonb_build_object('big', repeat('x', 200)), 'checkpoint');
SELECT phase, length(phase_data->>'big') AS data_chars FROM cp WHERE key = 'order-4';

-- Checkpoints counted: order-1 (2 + 1 rolled back + 1 rolled back to a
-- savepoint + 1 by attempt 3), order-2 (1), order-3 (1), order-4 (3).  A
-- call that raised counts nothing; a rolled-back call still counts, as the
-- claims do.
SELECT checkpoints IS NULL AS not_preloaded, checkpoints - :cp0 AS checkpoints
  FROM idempotency.stats WHERE database = current_database();

DELETE FROM idempotency.keys WHERE scope = 'checkpoint';
