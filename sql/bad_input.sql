--
-- bad_input.sql: every documented bad input raises its own
-- SQLSTATE (never XX000 or P0001) and leaves the table exactly as it was.
--
-- After each group of rejected calls, "unchanged" compares a checksum of
-- every row of this file's scope with the one taken before.
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
CREATE TEMP VIEW bad_state AS
SELECT count(*) AS rows, md5(coalesce(string_agg(k::text, '|' ORDER BY k.key), '')) AS sum
  FROM idempotency.keys k WHERE k.scope = 'bad';

-- pending: a live claim; done: a finished key
INSERT INTO r SELECT 'pending', * FROM idempotency.idem_claim('pending', '{"x": 1}', 'bad', lease => '1 hour')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'done', * FROM idempotency.idem_claim('done', '{"x": 2}', 'bad')
RETURNING step, outcome, attempt;
SELECT token AS tp FROM r WHERE step = 'pending' \gset
SELECT token AS td FROM r WHERE step = 'done' \gset
SELECT idempotency.idem_finish('done', :td, 200, '{"ok": true}', 'bad') IS NOT NULL AS finished;
SELECT rows, sum AS sum0 FROM bad_state \gset
\set unchanged 'SELECT sum = ' :'sum0' ' AS unchanged FROM bad_state;'
SELECT :rows AS rows;

--
-- idem_claim
--
-- NULL key, scope, wait: 22004
SELECT * FROM idempotency.idem_claim(NULL, '{"x": 1}', 'bad');
:unchanged
SELECT * FROM idempotency.idem_claim(NULL::text);
:unchanged
SELECT * FROM idempotency.idem_claim('pending', '{"x": 1}', NULL);
:unchanged
SELECT * FROM idempotency.idem_claim('new', '{"x": 1}', NULL);
:unchanged
SELECT * FROM idempotency.idem_claim('new', '{"x": 1}', 'bad', wait => NULL);
:unchanged
-- empty key: 22023 (an empty scope is the default scope, not an error)
SELECT * FROM idempotency.idem_claim('', '{"x": 1}', 'bad');
:unchanged
SELECT * FROM idempotency.idem_claim('');
:unchanged
-- key or scope over 255 characters: 22001
SELECT * FROM idempotency.idem_claim(repeat('x', 256), scope => 'bad');
:unchanged
SELECT * FROM idempotency.idem_claim('new', scope => repeat('x', 256));
:unchanged
-- lease or retention not positive: 22023
SELECT * FROM idempotency.idem_claim('new', scope => 'bad', lease => '0');
:unchanged
SELECT * FROM idempotency.idem_claim('new', scope => 'bad', lease => '-1 second');
:unchanged
SELECT * FROM idempotency.idem_claim('new', scope => 'bad', lease => '1 day -25 hours');
:unchanged
SELECT * FROM idempotency.idem_claim('pending', '{"x": 1}', 'bad', lease => '0');
:unchanged
SELECT * FROM idempotency.idem_claim('new', scope => 'bad', retention => '0');
:unchanged
SELECT * FROM idempotency.idem_claim('new', scope => 'bad', retention => '-1 day');
:unchanged
SELECT * FROM idempotency.idem_claim('done', '{"x": 2}', 'bad', retention => '-1 day');
:unchanged
-- negative wait: 22023
SELECT * FROM idempotency.idem_claim('new', scope => 'bad', wait => '-1 second');
:unchanged
SELECT * FROM idempotency.idem_claim('pending', '{"x": 1}', 'bad', wait => '-1 ms');
:unchanged
SELECT rows = :rows AS same_rows, sum = :'sum0' AS unchanged FROM bad_state;
-- a NULL request is no error: it means "no payload"
SELECT outcome, attempt FROM idempotency.idem_claim('no-payload', NULL, 'bad');
SELECT outcome FROM idempotency.idem_claim('pending', NULL, 'bad');
DELETE FROM idempotency.keys WHERE scope = 'bad' AND key = 'no-payload';
-- wait of zero is the default
SELECT outcome FROM idempotency.idem_claim('pending', '{"x": 1}', 'bad', wait => '0');

--
-- idem_finish
--
-- NULL key, token, scope, status: 22004
SELECT idempotency.idem_finish(NULL, :tp, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish('pending', NULL, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, NULL);
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', NULL);
:unchanged
-- empty key: 22023; key or scope over 255: 22001
SELECT idempotency.idem_finish('', :tp, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish(repeat('x', 256), :tp, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, repeat('x', 256));
:unchanged
-- unknown status (only 'succeeded' and 'failed'): 22023
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', 'pending');
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', 'SUCCEEDED');
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', 'succeeded ');
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', 'ok');
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', '');
:unchanged
-- retention not positive: 22023
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', retention => '0');
:unchanged
SELECT idempotency.idem_finish('pending', :tp, 200, NULL, 'bad', retention => '-1 hour');
:unchanged
-- response_body over the limit: 54000
SELECT idempotency.idem_finish('pending', :tp, 200,
       jsonb_build_object('big', repeat('x', 1048577)), 'bad');
:unchanged
-- absent key: P0002; a key finished by another token: 55000; a wrong
-- token on a pending key: 55006
SELECT idempotency.idem_finish('absent', :tp, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish('done', :tp, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish('pending', :td, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish('pending', -1, 200, NULL, 'bad');
:unchanged
-- bad input is checked before the key's state
SELECT idempotency.idem_finish('absent', NULL, 200, NULL, 'bad');
:unchanged
SELECT idempotency.idem_finish('done', :td, 200, NULL, 'bad', 'unknown');
:unchanged
SELECT rows = :rows AS same_rows, sum = :'sum0' AS unchanged FROM bad_state;

--
-- idem_extend
--
SELECT idempotency.idem_extend(NULL, :tp, '1 minute', 'bad');
:unchanged
SELECT idempotency.idem_extend('pending', NULL, '1 minute', 'bad');
:unchanged
SELECT idempotency.idem_extend('pending', :tp, '1 minute', NULL);
:unchanged
SELECT idempotency.idem_extend('', :tp, '1 minute', 'bad');
:unchanged
SELECT idempotency.idem_extend(repeat('x', 256), :tp, '1 minute', 'bad');
:unchanged
SELECT idempotency.idem_extend('pending', :tp, '1 minute', repeat('x', 256));
:unchanged
SELECT idempotency.idem_extend('pending', :tp, '0', 'bad');
:unchanged
SELECT idempotency.idem_extend('pending', :tp, '-5 minutes', 'bad');
:unchanged
SELECT idempotency.idem_extend('absent', :tp, '1 minute', 'bad');
:unchanged
SELECT idempotency.idem_extend('done', :td, '1 minute', 'bad');
:unchanged
SELECT idempotency.idem_extend('pending', :td, '1 minute', 'bad');
:unchanged
SELECT rows = :rows AS same_rows, sum = :'sum0' AS unchanged FROM bad_state;

--
-- idem_release
--
SELECT idempotency.idem_release(NULL, :tp, 'bad');
:unchanged
SELECT idempotency.idem_release('pending', NULL, 'bad');
:unchanged
SELECT idempotency.idem_release('pending', :tp, NULL);
:unchanged
SELECT idempotency.idem_release('', :tp, 'bad');
:unchanged
SELECT idempotency.idem_release(repeat('x', 256), :tp, 'bad');
:unchanged
SELECT idempotency.idem_release('pending', :tp, repeat('x', 256));
:unchanged
SELECT idempotency.idem_release('absent', :tp, 'bad');
:unchanged
SELECT idempotency.idem_release('done', :td, 'bad');
:unchanged
SELECT idempotency.idem_release('pending', :td, 'bad');
:unchanged
SELECT rows = :rows AS same_rows, sum = :'sum0' AS unchanged FROM bad_state;

--
-- idem_lookup
--
SELECT * FROM idempotency.idem_lookup(NULL, 'bad');
:unchanged
SELECT * FROM idempotency.idem_lookup('pending', NULL);
:unchanged
SELECT * FROM idempotency.idem_lookup('', 'bad');
:unchanged
SELECT * FROM idempotency.idem_lookup(repeat('x', 256), 'bad');
:unchanged
SELECT * FROM idempotency.idem_lookup('pending', repeat('x', 256));
:unchanged

--
-- idem_sweep: batch_size must be positive
--
SELECT * FROM idempotency.idem_sweep(0);
:unchanged
SELECT * FROM idempotency.idem_sweep(-100);
:unchanged
SELECT rows = :rows AS same_rows, sum = :'sum0' AS unchanged FROM bad_state;

-- Errors inside a transaction abort it; the claim made before is gone too.
BEGIN;
SELECT outcome FROM idempotency.idem_claim('in-tx', scope => 'bad');
SELECT idempotency.idem_finish('in-tx', NULL, 200, NULL, 'bad');
ROLLBACK;
SELECT rows = :rows AS same_rows, sum = :'sum0' AS unchanged FROM bad_state;

-- the good calls still work after all that
SELECT idempotency.idem_finish('pending', :tp, 200, '{"finally": true}', 'bad') IS NOT NULL AS finished;
SELECT outcome, response_body FROM idempotency.idem_claim('pending', '{"x": 1}', 'bad');

DELETE FROM idempotency.keys WHERE scope = 'bad';
