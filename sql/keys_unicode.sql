--
-- keys_unicode.sql: non-ASCII keys and scopes.  Byte-for-byte comparison:
-- no case folding, no Unicode normalisation; the 255 limit counts
-- characters, not bytes.  Needs a UTF8 database (keys_unicode_1.out is the
-- output elsewhere).
--
SELECT getdatabaseencoding() <> 'UTF8' AS skip_test \gset
\if :skip_test
\quit
\endif
\set VERBOSITY sqlstate
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);

-- é precomposed (U+00E9) and decomposed (e + U+0301) are different keys
INSERT INTO r SELECT 'nfc', * FROM idempotency.idem_claim(U&'caf\00E9', scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'nfd', * FROM idempotency.idem_claim(U&'cafe\0301', scope => 'unicode')
RETURNING step, outcome, attempt;
-- Kelvin sign (U+212A) vs K, Ohm sign (U+2126) vs Omega (U+03A9), ß vs ss
INSERT INTO r SELECT 'kelvin', * FROM idempotency.idem_claim(U&'\212A', scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'K', * FROM idempotency.idem_claim('K', scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'ohm', * FROM idempotency.idem_claim(U&'\2126', scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'omega', * FROM idempotency.idem_claim(U&'\03A9', scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'sharp-s', * FROM idempotency.idem_claim(U&'stra\00DFe', scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'ss', * FROM idempotency.idem_claim('strasse', scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'emoji', * FROM idempotency.idem_claim(U&'\+01F511', scope => U&'t\+01F3E0')
RETURNING step, outcome, attempt;
-- each one finds itself again
SELECT idempotency.idem_finish(U&'caf\00E9', token, 200, U&'{"caf\00E9": "\00E9"}', 'unicode') IS NOT NULL AS finished
  FROM r WHERE step = 'nfc';
SELECT outcome, response_body FROM idempotency.idem_claim(U&'caf\00E9', scope => 'unicode');
SELECT outcome FROM idempotency.idem_claim(U&'cafe\0301', scope => 'unicode');
SELECT outcome FROM idempotency.idem_claim(U&'\+01F511', scope => U&'t\+01F3E0');
SELECT count(*) AS rows FROM idempotency.idem_lookup(U&'\+01F511', 't');
SELECT encode(convert_to(key, 'UTF8'), 'hex') AS utf8_hex, key = normalize(key, NFC) AS is_nfc,
       length(key) AS len, octet_length(key) AS bytes, status
  FROM idempotency.keys WHERE scope = 'unicode' ORDER BY key;

-- request fingerprints are over the UTF-8 bytes: NFC and NFD payloads differ
INSERT INTO r SELECT 'fp', * FROM idempotency.idem_claim('fp', U&'{"name": "caf\00E9"}', 'unicode')
RETURNING step, outcome, attempt;
SELECT outcome FROM idempotency.idem_claim('fp', U&'{"name": "cafe\0301"}', 'unicode');
SELECT outcome FROM idempotency.idem_claim('fp', '{"name": "caf\u00e9"}', 'unicode');
SELECT fingerprint = sha256(convert_to(U&'{"name": "caf\00E9"}', 'UTF8')) AS fingerprint_sha256
  FROM idempotency.keys WHERE scope = 'unicode' AND key = 'fp';

-- 255 characters, whatever their byte length, is the limit; 256 is 22001
SELECT count(*) AS rows_before FROM idempotency.keys WHERE scope LIKE 'unicode%' OR length(scope) > 250 \gset
INSERT INTO r SELECT 'e255', * FROM idempotency.idem_claim(repeat(U&'\00E9', 255), scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'emoji255', * FROM idempotency.idem_claim(repeat(U&'\+01F511', 255), scope => 'unicode')
RETURNING step, outcome, attempt;
INSERT INTO r SELECT 'scope255', * FROM idempotency.idem_claim('k', scope => repeat(U&'\0436', 255))
RETURNING step, outcome, attempt;
SELECT outcome FROM idempotency.idem_claim(repeat(U&'\00E9', 256), scope => 'unicode');
SELECT outcome FROM idempotency.idem_claim(repeat(U&'\+01F511', 256), scope => 'unicode');
SELECT outcome FROM idempotency.idem_claim('k', scope => repeat(U&'\0436', 256));
SELECT count(*) - :rows_before AS new_rows FROM idempotency.keys WHERE scope LIKE 'unicode%' OR length(scope) > 250;
SELECT length(key) AS len, octet_length(key) AS bytes, length(scope) AS scope_len, status
  FROM idempotency.keys WHERE (scope = 'unicode' AND length(key) = 255) OR length(scope) = 255
 ORDER BY bytes, scope_len;
SELECT idempotency.idem_finish(repeat(U&'\+01F511', 255), token, 200, NULL, 'unicode') IS NOT NULL AS finished
  FROM r WHERE step = 'emoji255';
SELECT status FROM idempotency.idem_lookup(repeat(U&'\+01F511', 255), 'unicode');

DELETE FROM idempotency.keys WHERE scope IN ('unicode', U&'t\+01F3E0') OR scope = repeat(U&'\0436', 255);
