--
-- gucs.sql: the settings (names, defaults, units, contexts), changing them,
-- rejecting bad values, and claim/finish/extend using them.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

-- Defaults.  The user-settable ones through SHOW; the sighup ones through
-- their compiled-in default, whatever the server's configuration file says.
SHOW idempotency.lease;
SHOW idempotency.retention;
SHOW idempotency.max_response_size;
SELECT name, unit, context, vartype, boot_val
  FROM pg_settings WHERE name LIKE 'idempotency.%' ORDER BY name;
SELECT current_setting('idempotency.lease') = '30s' AS lease_30s,
       current_setting('idempotency.retention') = '1d' AS retention_24h,
       current_setting('idempotency.max_response_size') = '1MB' AS max_1mb;

-- Setting the user GUCs, with and without units.
SET idempotency.lease = '5min';
SHOW idempotency.lease;
SET idempotency.lease = 2500;
SHOW idempotency.lease;
SET idempotency.retention = '2h';
SHOW idempotency.retention;
SET idempotency.retention = 90;
SHOW idempotency.retention;
RESET idempotency.lease;
RESET idempotency.retention;
SHOW idempotency.lease;
SHOW idempotency.retention;

-- Bad values are refused (22023) and leave the setting alone.
SET idempotency.lease = 0;
SET idempotency.lease = '-1s';
SET idempotency.lease = 'soon';
SET idempotency.retention = 0;
SET idempotency.retention = '-1h';
SHOW idempotency.lease;
SHOW idempotency.retention;

-- sighup settings cannot be changed in a session (55P02).
SET idempotency.sweep_batch = 10;
SET idempotency.sweep_interval = '1s';

-- max_response_size is superuser-only (42501 for anyone else).
CREATE ROLE regress_idem_gucs_user;
SET ROLE regress_idem_gucs_user;
SET idempotency.max_response_size = '2MB';
SHOW idempotency.max_response_size;
-- but the user settings are theirs to change
SET idempotency.lease = '10s';
SHOW idempotency.lease;
RESET idempotency.lease;
RESET ROLE;
DROP ROLE regress_idem_gucs_user;

--
-- A claim without lease/retention uses idempotency.lease / .retention.
--
SET idempotency.lease = '2min';
SET idempotency.retention = '3h';
SELECT clock_timestamp() AS b1 \gset
INSERT INTO r SELECT 'g1', * FROM idempotency.idem_claim('g1', scope => 'gucs')
RETURNING step, outcome, token IS NOT NULL AS has_token, attempt;
SELECT clock_timestamp() AS a1 \gset
SELECT k.lease_until BETWEEN :'b1'::timestamptz + '2 min'
                         AND :'a1'::timestamptz + '2 min' AS lease_from_guc,
       k.retention = '3 hours' AS retention_from_guc,
       k.expires_at BETWEEN :'b1'::timestamptz + '3 hours'
                        AND :'a1'::timestamptz + '3 hours' AS expires_after_retention
  FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g1';
-- retry_after counts down the 2 minute lease
INSERT INTO r SELECT 'g1-again', * FROM idempotency.idem_claim('g1', scope => 'gucs')
RETURNING step, outcome, token, retry_after BETWEEN 100 AND 120 AS retry_after_in_lease;

-- extend without a lease uses the GUC at the time of the extend
SET idempotency.lease = '10min';
SELECT token AS g1 FROM r WHERE step = 'g1' \gset
SELECT clock_timestamp() AS b2 \gset
SELECT idempotency.idem_extend('g1', :g1, scope => 'gucs') AS ext \gset
SELECT clock_timestamp() AS a2 \gset
SELECT :'ext'::timestamptz BETWEEN :'b2'::timestamptz + '10 min'
                              AND :'a2'::timestamptz + '10 min' AS extended_by_guc,
       k.lease_until = :'ext' AS stored
  FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g1';

-- finish without a retention keeps the claim's retention (3h), not the
-- current GUC
SET idempotency.retention = '5h';
SELECT clock_timestamp() AS b3 \gset
SELECT idempotency.idem_finish('g1', :g1, 200, '{"ok": true}', 'gucs') AS fin \gset
SELECT clock_timestamp() AS a3 \gset
SELECT :'fin'::timestamptz BETWEEN :'b3'::timestamptz + '3 hours'
                              AND :'a3'::timestamptz + '3 hours' AS kept_claims_retention,
       k.expires_at = :'fin' AS stored, k.status
  FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g1';
RESET idempotency.lease;
RESET idempotency.retention;

-- SET LOCAL works for one transaction
BEGIN;
SET LOCAL idempotency.lease = '1h';
SELECT clock_timestamp() AS b4 \gset
INSERT INTO r SELECT 'g2', * FROM idempotency.idem_claim('g2', scope => 'gucs')
RETURNING step, outcome, attempt;
SELECT k.lease_until >= :'b4'::timestamptz + '1 hour' AS local_lease
  FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g2';
COMMIT;
SHOW idempotency.lease;

--
-- max_response_size: bodies over the limit are refused with 54000 and the
-- key stays as it was.
--
SET idempotency.max_response_size = '1kB';
SHOW idempotency.max_response_size;
INSERT INTO r SELECT 'g3', * FROM idempotency.idem_claim('g3', scope => 'gucs')
RETURNING step, outcome, attempt;
SELECT token AS g3 FROM r WHERE step = 'g3' \gset
SELECT k::text AS g3_row FROM idempotency.keys k
 WHERE k.scope = 'gucs' AND k.key = 'g3' \gset
SELECT idempotency.idem_finish('g3', :g3, 200,
       jsonb_build_object('pad', repeat('x', 2000)), 'gucs') IS NOT NULL AS finished;
SELECT k::text = :'g3_row' AS unchanged, k.status, k.response_body IS NULL AS no_body
  FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g3';
-- a body under the limit is stored
SELECT idempotency.idem_finish('g3', :g3, 200,
       jsonb_build_object('pad', repeat('y', 500)), 'gucs') IS NOT NULL AS finished;
SELECT k.status, length(k.response_body->>'pad') AS pad
  FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g3';
RESET idempotency.max_response_size;
-- the default limit is 1MB: 2000 bytes are fine, 2MB are not
INSERT INTO r SELECT 'g4', * FROM idempotency.idem_claim('g4', scope => 'gucs')
RETURNING step, outcome, attempt;
SELECT token AS g4 FROM r WHERE step = 'g4' \gset
SELECT idempotency.idem_finish('g4', :g4, 200,
       jsonb_build_object('pad', repeat('x', 2 * 1024 * 1024)), 'gucs') IS NOT NULL AS finished;
SELECT k.status FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g4';
-- the size is measured before compression: a body read from a table, where
-- it is stored compressed, is refused too
CREATE TEMP TABLE bodies (b jsonb);
INSERT INTO bodies SELECT jsonb_build_object('pad', repeat('x', 2 * 1024 * 1024));
SELECT pg_column_size(b) < 1024 * 1024 AS stored_compressed FROM bodies;
SELECT idempotency.idem_finish('g4', :g4, 200, b, 'gucs') IS NOT NULL AS finished FROM bodies;
SELECT k.status FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g4';
SELECT idempotency.idem_finish('g4', :g4, 200,
       jsonb_build_object('pad', repeat('x', 2000)), 'gucs') IS NOT NULL AS finished;
SELECT k.status, length(k.response_body->>'pad') AS pad
  FROM idempotency.keys k WHERE k.scope = 'gucs' AND k.key = 'g4';

DELETE FROM idempotency.keys WHERE scope = 'gucs';
