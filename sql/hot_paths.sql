--
-- hot_paths.sql: the answers that change nothing (replay, in_progress,
-- mismatch) and lookup are read-only: inside a transaction they leave it
-- without a transaction id, so they write nothing and cost no WAL.
--
\set VERBOSITY sqlstate

-- setup, in autocommit: a finished key, a failed key, a pending key with a
-- live lease
SELECT outcome FROM idempotency.idem_claim('done', '{"p": 1}', 'hot');
SELECT idempotency.idem_finish('done', k.token, 200, '{"r": 1}', 'hot') IS NOT NULL AS finished
  FROM idempotency.keys k WHERE k.scope = 'hot' AND k.key = 'done';
SELECT outcome FROM idempotency.idem_claim('failed', '{"p": 2}', 'hot');
SELECT idempotency.idem_finish('failed', k.token, 500, '{"r": 2}', 'hot', 'failed') IS NOT NULL AS finished
  FROM idempotency.keys k WHERE k.scope = 'hot' AND k.key = 'failed';
SELECT outcome FROM idempotency.idem_claim('busy', '{"p": 3}', 'hot', lease => '1 hour');
SELECT md5(string_agg(k::text, '|' ORDER BY k.key)) AS before_sum
  FROM idempotency.keys k WHERE k.scope = 'hot' \gset

BEGIN;
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_at_start;
SELECT outcome, status, response_code, response_body
  FROM idempotency.idem_claim('done', '{"p": 1}', 'hot');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_after_replay;
SELECT outcome, status, response_code
  FROM idempotency.idem_claim('failed', '{"p": 2}', 'hot');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_after_failed_replay;
SELECT outcome, token, retry_after BETWEEN 3500 AND 3600 AS retry_after_1h
  FROM idempotency.idem_claim('busy', '{"p": 3}', 'hot');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_after_in_progress;
SELECT outcome FROM idempotency.idem_claim('done', '{"p": "other"}', 'hot');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_after_mismatch_finished;
SELECT outcome FROM idempotency.idem_claim('busy', '{"p": "other"}', 'hot');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_after_mismatch_pending;
SELECT outcome FROM idempotency.idem_claim('busy', '{"p": 3}', 'hot', wait => '10 ms');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_after_wait;
SELECT status, attempt FROM idempotency.idem_lookup('done', 'hot');
SELECT count(*) AS rows FROM idempotency.idem_lookup('absent', 'hot');
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid_after_lookup;
COMMIT;

-- the same in a single statement, many times over (the function in the
-- select list is called once per row)
BEGIN;
SELECT outcome, count(*) FROM (
    SELECT (idempotency.idem_claim('done', '{"p": 1}', 'hot')).outcome
      FROM generate_series(1, 100)) s GROUP BY outcome;
SELECT outcome, count(*) FROM (
    SELECT (idempotency.idem_claim('busy', '{"p": 3}', 'hot')).outcome
      FROM generate_series(1, 100)) s GROUP BY outcome;
SELECT outcome, count(*) FROM (
    SELECT (idempotency.idem_claim('done', jsonb_build_object('g', g), 'hot')).outcome
      FROM generate_series(1, 100) g) s GROUP BY outcome;
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_xid;
COMMIT;

-- and indeed nothing changed
SELECT md5(string_agg(k::text, '|' ORDER BY k.key)) = :'before_sum' AS unchanged
  FROM idempotency.keys k WHERE k.scope = 'hot';

-- a claim that does claim is a write (it gets a transaction id)
BEGIN;
SELECT outcome FROM idempotency.idem_claim('new', scope => 'hot');
SELECT pg_current_xact_id_if_assigned() IS NOT NULL AS xid_after_claim;
ROLLBACK;

DELETE FROM idempotency.keys WHERE scope = 'hot';
