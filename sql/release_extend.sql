--
-- release_extend.sql: idem_release gives a claim up (the key disappears, the
-- next claim is a fresh attempt 1 with any payload); idem_extend pushes a
-- live claim's lease (and its expiry) forward.  Both follow finish's token
-- rules.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

--
-- release
--
INSERT INTO r SELECT 'r1', * FROM idempotency.idem_claim('rel1', '{"v": 1}', 'relext')
RETURNING step, outcome, attempt;
SELECT token AS r1 FROM r WHERE step = 'r1' \gset
SELECT k::text AS rel1_row FROM idempotency.keys k WHERE k.scope = 'relext' AND k.key = 'rel1' \gset
-- a wrong token: 55006, nothing changes
SELECT idempotency.idem_release('rel1', :r1 + 1000000, 'relext');
SELECT k::text = :'rel1_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'relext' AND k.key = 'rel1';
-- the right token: void, and the key is gone
SELECT pg_typeof(idempotency.idem_release('rel1', :r1, 'relext')) AS returns;
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'relext' AND key = 'rel1';
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('rel1', 'relext');
-- releasing again: the key is absent (P0002)
SELECT idempotency.idem_release('rel1', :r1, 'relext');
-- finishing or extending with the released token: absent (P0002)
SELECT idempotency.idem_finish('rel1', :r1, 200, NULL, 'relext');
SELECT idempotency.idem_extend('rel1', :r1, '1 minute', 'relext');
-- the next claim is a fresh first attempt, with any payload, and a larger token
INSERT INTO r SELECT 'r2', * FROM idempotency.idem_claim('rel1', '{"v": "different"}', 'relext')
RETURNING step, outcome, attempt, token > :r1 AS larger_token;
SELECT token AS r2 FROM r WHERE step = 'r2' \gset
SELECT status, attempt, token = :r2 AS new_token,
       fingerprint = sha256(convert_to('{"v": "different"}'::jsonb::text, 'UTF8')) AS new_fingerprint
  FROM idempotency.keys WHERE scope = 'relext' AND key = 'rel1';
-- the released token stays dead for the new attempt
SELECT idempotency.idem_release('rel1', :r1, 'relext');
SELECT idempotency.idem_finish('rel1', :r1, 200, NULL, 'relext');
-- releasing a finished key: 55000, nothing changes
SELECT idempotency.idem_finish('rel1', :r2, 200, '{"done": true}', 'relext') IS NOT NULL AS finished;
SELECT k::text AS rel1_row FROM idempotency.keys k WHERE k.scope = 'relext' AND k.key = 'rel1' \gset
SELECT idempotency.idem_release('rel1', :r2, 'relext');
SELECT idempotency.idem_release('rel1', :r1, 'relext');
SELECT k::text = :'rel1_row' AS unchanged, k.status FROM idempotency.keys k
 WHERE k.scope = 'relext' AND k.key = 'rel1';
-- release of a key never claimed, and in the wrong scope: P0002
SELECT idempotency.idem_release('rel-absent', :r2, 'relext');
SELECT idempotency.idem_release('rel1', :r2, 'relext-other');
-- release in the default scope
INSERT INTO r SELECT 'r3', * FROM idempotency.idem_claim('relext:default')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_release('relext:default', token) AS released FROM r WHERE step = 'r3';
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = '' AND key = 'relext:default';
-- release of a live claim, then a claim on a previously mismatching payload
INSERT INTO r SELECT 'r4', * FROM idempotency.idem_claim('rel2', '{"v": 1}', 'relext')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'r4-mismatch', * FROM idempotency.idem_claim('rel2', '{"v": 2}', 'relext')
RETURNING step, outcome;
SELECT idempotency.idem_release('rel2', token, 'relext') AS released FROM r WHERE step = 'r4';
INSERT INTO r SELECT 'r5', * FROM idempotency.idem_claim('rel2', '{"v": 2}', 'relext')
RETURNING step, outcome, attempt;

--
-- extend
--
INSERT INTO r SELECT 'x1', * FROM idempotency.idem_claim('ext1', scope => 'relext', lease => '10 seconds')
RETURNING step, outcome, attempt;
SELECT token AS x1 FROM r WHERE step = 'x1' \gset
SELECT clock_timestamp() AS b1 \gset
SELECT idempotency.idem_extend('ext1', :x1, '1 hour', 'relext') AS l1 \gset
SELECT clock_timestamp() AS a1 \gset
-- returns the new deadline, which is stored; the expiry stays
-- greatest(now + retention, lease end) = about now + 1 day
SELECT :'l1'::timestamptz BETWEEN :'b1'::timestamptz + '1 hour'
                              AND :'a1'::timestamptz + '1 hour' AS deadline_1h,
       k.lease_until = :'l1' AS stored, k.status, k.attempt, k.token = :x1 AS same_token,
       k.expires_at BETWEEN :'b1'::timestamptz + '1 day'
                        AND :'a1'::timestamptz + '1 day' AS expires_1d
  FROM idempotency.keys k WHERE k.scope = 'relext' AND k.key = 'ext1';
-- a claim now sees about an hour left
INSERT INTO r SELECT 'x1-live', * FROM idempotency.idem_claim('ext1', scope => 'relext')
RETURNING step, outcome, token, retry_after BETWEEN 3500 AND 3600 AS retry_after_1h;
-- extending past the retention pushes the expiry to the end of the lease
SELECT clock_timestamp() AS b2 \gset
SELECT idempotency.idem_extend('ext1', :x1, '3 days', 'relext') AS l2 \gset
SELECT clock_timestamp() AS a2 \gset
SELECT :'l2'::timestamptz BETWEEN :'b2'::timestamptz + '3 days'
                              AND :'a2'::timestamptz + '3 days' AS deadline_3d,
       k.lease_until = :'l2' AS stored, k.expires_at = k.lease_until AS expires_at_lease_end
  FROM idempotency.keys k WHERE k.scope = 'relext' AND k.key = 'ext1';
-- extending to a shorter lease is allowed: the deadline is now + lease
SELECT clock_timestamp() AS b3 \gset
SELECT idempotency.idem_extend('ext1', :x1, '5 minutes', 'relext') AS l3 \gset
SELECT clock_timestamp() AS a3 \gset
SELECT :'l3'::timestamptz BETWEEN :'b3'::timestamptz + '5 minutes'
                              AND :'a3'::timestamptz + '5 minutes' AS deadline_5min,
       k.lease_until = :'l3' AS stored,
       k.expires_at BETWEEN :'b3'::timestamptz + '1 day'
                        AND :'a3'::timestamptz + '1 day' AS expires_1d
  FROM idempotency.keys k WHERE k.scope = 'relext' AND k.key = 'ext1';
-- the default lease is the GUC (30 s)
SELECT clock_timestamp() AS b4 \gset
SELECT idempotency.idem_extend('ext1', :x1, scope => 'relext') AS l4 \gset
SELECT clock_timestamp() AS a4 \gset
SELECT :'l4'::timestamptz BETWEEN :'b4'::timestamptz + '30 s'
                              AND :'a4'::timestamptz + '30 s' AS deadline_30s;
-- a wrong token: 55006; an absent key or another scope: P0002; all change nothing
SELECT k::text AS ext1_row FROM idempotency.keys k WHERE k.scope = 'relext' AND k.key = 'ext1' \gset
SELECT idempotency.idem_extend('ext1', :x1 + 1000000, '1 hour', 'relext');
SELECT idempotency.idem_extend('ext-absent', :x1, '1 hour', 'relext');
SELECT idempotency.idem_extend('ext1', :x1, '1 hour', 'relext-other');
SELECT k::text = :'ext1_row' AS unchanged FROM idempotency.keys k
 WHERE k.scope = 'relext' AND k.key = 'ext1';
-- the finish after extends: a normal finish, then extend of a finished key: 55000
SELECT idempotency.idem_finish('ext1', :x1, 200, '{"long": "job"}', 'relext') IS NOT NULL AS finished;
SELECT k::text AS ext1_row FROM idempotency.keys k WHERE k.scope = 'relext' AND k.key = 'ext1' \gset
SELECT idempotency.idem_extend('ext1', :x1, '1 hour', 'relext');
SELECT k::text = :'ext1_row' AS unchanged, k.status FROM idempotency.keys k
 WHERE k.scope = 'relext' AND k.key = 'ext1';

-- Extending an ended lease that nobody took over still works (the token is
-- current); the row lock keeps the background sweeper from resetting it.
INSERT INTO r SELECT 'x2', * FROM idempotency.idem_claim('ext2', scope => 'relext', lease => '1 second')
RETURNING step, outcome, attempt;
SELECT token AS x2 FROM r WHERE step = 'x2' \gset
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'relext' AND key = 'ext2' FOR UPDATE) l;
SELECT pg_sleep(1.1);
SELECT lease_until < clock_timestamp() AS lease_ended FROM idempotency.keys
 WHERE scope = 'relext' AND key = 'ext2';
SELECT idempotency.idem_extend('ext2', :x2, '1 hour', 'relext') > clock_timestamp() + '59 minutes' AS extended;
COMMIT;
-- so the key is live again: in_progress, not a takeover
INSERT INTO r SELECT 'x2-live', * FROM idempotency.idem_claim('ext2', scope => 'relext')
RETURNING step, outcome, token, retry_after BETWEEN 3500 AND 3600 AS retry_after_1h;
SELECT status, attempt, token = :x2 AS same_token FROM idempotency.keys
 WHERE scope = 'relext' AND key = 'ext2';
-- releasing an ended lease nobody took over works too
INSERT INTO r SELECT 'x3', * FROM idempotency.idem_claim('ext3', scope => 'relext', lease => '1 second')
RETURNING step, outcome, attempt;
BEGIN;
SELECT count(*) AS locked
  FROM (SELECT 1 FROM idempotency.keys WHERE scope = 'relext' AND key = 'ext3' FOR UPDATE) l;
SELECT pg_sleep(1.1);
SELECT idempotency.idem_release('ext3', token, 'relext') AS released FROM r WHERE step = 'x3';
COMMIT;
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = 'relext' AND key = 'ext3';

DELETE FROM idempotency.keys WHERE scope = 'relext';
