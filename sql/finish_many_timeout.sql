--
-- finish_many_timeout.sql: idem_finish_many interrupted by statement_timeout
-- at several points of a 10,000-key batch (while its arguments are checked,
-- between elements, inside one).  Whatever the moment, the call raises
-- 57014 or finishes the batch, never anything else and never a crash, and
-- the batch is all or nothing: no key of a cancelled batch is finished.
--
\set VERBOSITY sqlstate

CREATE FUNCTION pg_temp.finish_batch(p_scope text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
	PERFORM count(*) FROM idempotency.idem_finish_many(
		(SELECT array_agg(key ORDER BY key) FROM fmt_claims WHERE scope = p_scope),
		(SELECT array_agg(token ORDER BY key) FROM fmt_claims WHERE scope = p_scope),
		scope => p_scope);
	RETURN 'finished';
EXCEPTION WHEN query_canceled THEN
	RETURN 'canceled';
END $$;

CREATE TABLE fmt_claims (scope text, key text, token bigint);
CREATE TABLE fmt_results (timeout text, result text);
INSERT INTO fmt_claims
SELECT 'fm-timeout-' || t, c.key, c.token
  FROM unnest(ARRAY['1ms', '2ms', '5ms', '10ms', '20ms', '50ms']) t,
       LATERAL idempotency.idem_claim_many(
           ARRAY(SELECT 'k' || g FROM generate_series(1, 10000) g),
           scope => 'fm-timeout-' || t, lease => '1 hour') c;

SET statement_timeout = '1ms';
SELECT pg_temp.finish_batch('fm-timeout-1ms') AS r \gset
RESET statement_timeout;
INSERT INTO fmt_results VALUES ('1ms', :'r');
SET statement_timeout = '2ms';
SELECT pg_temp.finish_batch('fm-timeout-2ms') AS r \gset
RESET statement_timeout;
INSERT INTO fmt_results VALUES ('2ms', :'r');
SET statement_timeout = '5ms';
SELECT pg_temp.finish_batch('fm-timeout-5ms') AS r \gset
RESET statement_timeout;
INSERT INTO fmt_results VALUES ('5ms', :'r');
SET statement_timeout = '10ms';
SELECT pg_temp.finish_batch('fm-timeout-10ms') AS r \gset
RESET statement_timeout;
INSERT INTO fmt_results VALUES ('10ms', :'r');
SET statement_timeout = '20ms';
SELECT pg_temp.finish_batch('fm-timeout-20ms') AS r \gset
RESET statement_timeout;
INSERT INTO fmt_results VALUES ('20ms', :'r');
SET statement_timeout = '50ms';
SELECT pg_temp.finish_batch('fm-timeout-50ms') AS r \gset
RESET statement_timeout;
INSERT INTO fmt_results VALUES ('50ms', :'r');

-- each batch: canceled with no key finished, or finished whole
SELECT r.timeout,
       (r.result = 'canceled' AND count(*) FILTER (WHERE k.status = 'succeeded') = 0) OR
       (r.result = 'finished' AND count(*) FILTER (WHERE k.status = 'succeeded') = 10000)
       AS all_or_nothing,
       count(*) AS keys
  FROM fmt_results r
  JOIN idempotency.keys k ON k.scope = 'fm-timeout-' || r.timeout
 GROUP BY r.timeout, r.result ORDER BY length(r.timeout), r.timeout;

DELETE FROM idempotency.keys WHERE scope LIKE 'fm-timeout-%';
DROP TABLE fmt_claims, fmt_results;
