--
-- keys_edge.sql: keys and scopes compare byte for byte (COLLATE "C"); any
-- text up to 255 characters is a key, stored exactly as given.  (Non-ASCII
-- keys: keys_unicode.sql.)
--
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

-- case, surrounding blanks: all different keys
INSERT INTO r SELECT 'lower', * FROM idempotency.idem_claim('a', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'upper', * FROM idempotency.idem_claim('A', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'trail', * FROM idempotency.idem_claim('a ', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'lead', * FROM idempotency.idem_claim(' a', scope => 'edge') RETURNING step, outcome, attempt;
SELECT idempotency.idem_finish('a', token, 200, '{"key": "a"}', 'edge') IS NOT NULL AS finished
  FROM r WHERE step = 'lower';
SELECT outcome, response_body FROM idempotency.idem_claim('a', scope => 'edge');
SELECT outcome, response_body FROM idempotency.idem_claim('A', scope => 'edge');
SELECT outcome FROM idempotency.idem_claim('a ', scope => 'edge');
-- the same for scopes: 'edge' and 'EDGE' and 'edge ' are different tenants
INSERT INTO r SELECT 'scope-upper', * FROM idempotency.idem_claim('a', scope => 'EDGE') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'scope-trail', * FROM idempotency.idem_claim('a', scope => 'edge ') RETURNING step, outcome, attempt;
-- the default scope '' and ' ' differ
INSERT INTO r SELECT 'scope-empty', * FROM idempotency.idem_claim('edge:blank') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'scope-blank', * FROM idempotency.idem_claim('edge:blank', scope => ' ') RETURNING step, outcome, attempt;

-- quotes, backslashes, SQL-looking text, LIKE wildcards, control characters
INSERT INTO r SELECT 'quotes', * FROM idempotency.idem_claim($$it's a "quoted" \back\slash\$$, scope => 'edge')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'sql', * FROM idempotency.idem_claim($$x'); DELETE FROM idempotency.keys; --$$, scope => 'edge')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'pct', * FROM idempotency.idem_claim('x%', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'xy', * FROM idempotency.idem_claim('xy', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'underscore', * FROM idempotency.idem_claim('x_', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'newline', * FROM idempotency.idem_claim(E'line1\nline2', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'tab', * FROM idempotency.idem_claim(E'tab\there', scope => 'edge') RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'scope-quote', * FROM idempotency.idem_claim('q', scope => $$o'brien\$$) RETURNING step, outcome, attempt;
-- each is found again exactly
SELECT outcome FROM idempotency.idem_claim($$it's a "quoted" \back\slash\$$, scope => 'edge');
SELECT idempotency.idem_finish($$it's a "quoted" \back\slash\$$, token, 200,
                               '{"s": "it''s \\ \"q\""}', 'edge') IS NOT NULL AS finished
  FROM r WHERE step = 'quotes';
SELECT outcome, response_body FROM idempotency.idem_claim($$it's a "quoted" \back\slash\$$, scope => 'edge');
SELECT outcome FROM idempotency.idem_claim(E'line1\nline2', scope => 'edge');
SELECT status FROM idempotency.idem_lookup('q', $$o'brien\$$);
SELECT count(*) AS lookup_rows FROM idempotency.idem_lookup('x', 'edge');
-- stored exactly, ordered by bytes
SELECT replace(replace(key, E'\n', '\n'), E'\t', '\t') AS key, length(key) AS len, status
  FROM idempotency.keys WHERE scope = 'edge' ORDER BY key;
SELECT quote_literal(k.scope) AS scope, k.key FROM idempotency.keys k
 WHERE k.scope IN ('EDGE', 'edge ', ' ', $$o'brien\$$) OR (k.scope = '' AND k.key = 'edge:blank')
 ORDER BY k.scope, k.key;

-- 255 characters is the limit for key and scope; 256 is refused (22001)
-- and leaves the table as it was
SELECT count(*) AS rows_before FROM idempotency.keys WHERE scope = 'edge' OR length(scope) > 250 \gset
INSERT INTO r SELECT 'key255', * FROM idempotency.idem_claim(repeat('k', 255), scope => 'edge')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'scope255', * FROM idempotency.idem_claim('s', scope => repeat('s', 255))
RETURNING step, outcome, attempt;
SELECT outcome FROM idempotency.idem_claim(repeat('k', 256), scope => 'edge');
SELECT outcome FROM idempotency.idem_claim('s', scope => repeat('s', 256));
SELECT outcome FROM idempotency.idem_claim(repeat('k', 1000), scope => repeat('s', 1000));
SELECT count(*) - :rows_before AS new_rows FROM idempotency.keys WHERE scope = 'edge' OR length(scope) > 250;
SELECT length(key) AS key_len, length(scope) AS scope_len, status FROM idempotency.keys
 WHERE (scope = 'edge' AND key = repeat('k', 255)) OR scope = repeat('s', 255) ORDER BY 1;
-- the long ones work with every function
SELECT idempotency.idem_extend(repeat('k', 255), token, '1 minute', 'edge') IS NOT NULL AS extended
  FROM r WHERE step = 'key255';
SELECT idempotency.idem_finish(repeat('k', 255), token, 200, NULL, 'edge') IS NOT NULL AS finished
  FROM r WHERE step = 'key255';
SELECT status FROM idempotency.idem_lookup(repeat('k', 255), 'edge');
SELECT idempotency.idem_release('s', token, repeat('s', 255)) AS released
  FROM r WHERE step = 'scope255';
SELECT count(*) AS rows FROM idempotency.keys WHERE scope = repeat('s', 255);
-- and 256 is refused by them too
SELECT idempotency.idem_finish(repeat('k', 256), token, 200, NULL, 'edge') FROM r WHERE step = 'key255';
SELECT idempotency.idem_extend(repeat('k', 256), token, '1 minute', 'edge') FROM r WHERE step = 'key255';
SELECT idempotency.idem_release(repeat('k', 256), token, 'edge') FROM r WHERE step = 'key255';
SELECT * FROM idempotency.idem_lookup(repeat('k', 256), 'edge');
SELECT idempotency.idem_finish('s', token, 200, NULL, repeat('s', 256)) FROM r WHERE step = 'scope255';
SELECT * FROM idempotency.idem_lookup('s', repeat('s', 256));

DELETE FROM idempotency.keys
 WHERE scope IN ('edge', 'EDGE', 'edge ', ' ', $$o'brien\$$) OR scope = repeat('s', 255)
    OR (scope = '' AND key = 'edge:blank');
