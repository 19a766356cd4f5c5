--
-- tenant.sql: scope bindings.  A role bound to a prefix may only use scopes
-- starting with it, in every client function (else 42501, nothing
-- changes); unbound roles are not restricted; the role checked is
-- current_user; changes are seen at the next call, rollbacks undo them.
--
\set VERBOSITY sqlstate
CREATE ROLE regress_tenant_a;
CREATE ROLE regress_tenant_b;
CREATE ROLE regress_tenant_free;
CREATE ROLE regress_tenant_a_member IN ROLE regress_tenant_a;
GRANT USAGE ON SCHEMA idempotency
   TO regress_tenant_a, regress_tenant_b, regress_tenant_free, regress_tenant_a_member;
CREATE TEMP TABLE r (step text PRIMARY KEY, outcome text, token bigint,
	attempt int, status text, response_code int, response_body jsonb,
	retry_after int, phase text, phase_data jsonb, n serial);
GRANT ALL ON r TO PUBLIC;
GRANT ALL ON SEQUENCE r_n_seq TO PUBLIC;
CREATE TEMP VIEW tenant_state AS
SELECT count(*) AS rows, md5(coalesce(string_agg(k::text, '|' ORDER BY k.scope, k.key), '')) AS sum
  FROM idempotency.keys k WHERE k.scope LIKE 'tenant%' OR k.scope LIKE 'a:%' OR k.scope LIKE 'b:%';

-- bind_scope / unbind_scope
SELECT idempotency.bind_scope('regress_tenant_a', 'a:') AS bound;
SELECT idempotency.bind_scope('regress_tenant_b', 'b:') AS bound;
SELECT idempotency.bind_scope(NULL, 'x:') IS NULL AS strict_null;
SELECT idempotency.unbind_scope('regress_tenant_free') AS was_bound;
SELECT role::text, scope_prefix FROM idempotency.scope_bindings
 WHERE role::text LIKE 'regress_tenant%' ORDER BY 1;

--
-- Tenant a: its own scopes work
--
SET ROLE regress_tenant_a;
INSERT INTO r SELECT 'a1', * FROM idempotency.idem_claim('k', '{"t": "a"}', 'a:orders')
RETURNING step, outcome, attempt;
SELECT token AS a1 FROM r WHERE step = 'a1' \gset
SELECT idempotency.idem_extend('k', :a1, '1 minute', 'a:orders') IS NOT NULL AS extended;
SELECT status FROM idempotency.idem_lookup('k', 'a:orders');
SELECT idempotency.idem_finish('k', :a1, 200, '{"t": "a"}', 'a:orders') IS NOT NULL AS finished;
SELECT outcome, response_body FROM idempotency.idem_claim('k', '{"t": "a"}', 'a:orders');
INSERT INTO r SELECT 'a2', * FROM idempotency.idem_claim('k2', scope => 'a:')
RETURNING step, outcome, attempt;
SELECT idempotency.idem_release('k2', token, 'a:') AS released FROM r WHERE step = 'a2';
RESET ROLE;

--
-- Tenant b claims in its scope; tenant a cannot touch it, with any function
--
SET ROLE regress_tenant_b;
INSERT INTO r SELECT 'b1', * FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders')
RETURNING step, outcome, attempt;
RESET ROLE;
SELECT token AS b1 FROM r WHERE step = 'b1' \gset
SELECT rows, sum AS sum0 FROM tenant_state \gset
\set unchanged 'SELECT sum = ' :'sum0' ' AS unchanged FROM tenant_state;'

SET ROLE regress_tenant_a;
SELECT * FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
SELECT idempotency.idem_finish('k', :b1, 200, '{"forged": true}', 'b:orders');
SELECT idempotency.idem_extend('k', :b1, '1 hour', 'b:orders');
SELECT idempotency.idem_release('k', :b1, 'b:orders');
SELECT * FROM idempotency.idem_lookup('k', 'b:orders');
-- the default scope, a prefix of the prefix, another case, a look-alike
SELECT * FROM idempotency.idem_claim('k');
SELECT * FROM idempotency.idem_claim('k', scope => 'a');
SELECT * FROM idempotency.idem_claim('k', scope => 'A:orders');
SELECT * FROM idempotency.idem_claim('k', scope => ' a:orders');
SELECT * FROM idempotency.idem_claim('k', scope => 'tenant-a:orders');
RESET ROLE;
:unchanged
SELECT status, response_body FROM idempotency.keys WHERE scope = 'b:orders' AND key = 'k';

-- the check is on current_user: a member of tenant a is its own (unbound)
-- role, and a SECURITY DEFINER function runs as its owner
SET ROLE regress_tenant_a_member;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
RESET ROLE;
CREATE FUNCTION public.regress_lookup_as_owner(k text, s text) RETURNS text
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog
AS $$ SELECT status FROM idempotency.idem_lookup(k, s) $$;
SET ROLE regress_tenant_a;
SELECT public.regress_lookup_as_owner('k', 'b:orders') AS status_via_definer;
RESET ROLE;
DROP FUNCTION public.regress_lookup_as_owner(text, text);

-- unbound roles and superusers are not restricted
SET ROLE regress_tenant_free;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "a"}', 'a:orders');
RESET ROLE;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "a"}', 'a:orders');

--
-- Changes are seen at the next call of the same session
--
-- re-binding moves the prefix
SELECT idempotency.bind_scope('regress_tenant_b', 'bb:') AS rebound;
SET ROLE regress_tenant_b;
SELECT idempotency.idem_finish('k', :b1, 201, '{"t": "b"}', 'b:orders');
RESET ROLE;
SELECT idempotency.bind_scope('regress_tenant_b', 'b:') AS rebound;
SET ROLE regress_tenant_b;
SELECT idempotency.idem_finish('k', :b1, 201, '{"t": "b"}', 'b:orders') IS NOT NULL AS finished;
RESET ROLE;
-- unbinding lifts the restriction
SELECT idempotency.unbind_scope('regress_tenant_a') AS was_bound;
SET ROLE regress_tenant_a;
SELECT outcome, response_body FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
RESET ROLE;
-- a binding made and rolled back in a transaction applies only inside it
BEGIN;
SELECT idempotency.bind_scope('regress_tenant_a', 'a:') AS bound;
SET LOCAL ROLE regress_tenant_a;
SAVEPOINT s;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
ROLLBACK TO SAVEPOINT s;
ROLLBACK;
SET ROLE regress_tenant_a;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
RESET ROLE;
-- an empty prefix allows every scope
SELECT idempotency.bind_scope('regress_tenant_a', '') AS bound;
SET ROLE regress_tenant_a;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
SELECT outcome FROM idempotency.idem_claim('tenant:k');
RESET ROLE;
-- a change by hand to the table is seen too (statement trigger)
UPDATE idempotency.scope_bindings SET scope_prefix = 'a:'
 WHERE role = 'regress_tenant_a'::regrole;
SET ROLE regress_tenant_a;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
RESET ROLE;
DELETE FROM idempotency.scope_bindings WHERE role = 'regress_tenant_a'::regrole;
SET ROLE regress_tenant_a;
SELECT outcome FROM idempotency.idem_claim('k', '{"t": "b"}', 'b:orders');
RESET ROLE;

-- clean up
SELECT idempotency.unbind_scope('regress_tenant_b') AS was_bound;
SELECT count(*) AS bindings_left FROM idempotency.scope_bindings
 WHERE role::text LIKE 'regress_tenant%';
DELETE FROM idempotency.keys
 WHERE scope IN ('a:orders', 'a:', 'b:orders') OR (scope = '' AND key = 'tenant:k');
REVOKE USAGE ON SCHEMA idempotency
  FROM regress_tenant_a, regress_tenant_b, regress_tenant_free, regress_tenant_a_member;
DROP ROLE regress_tenant_a_member;
DROP ROLE regress_tenant_a;
DROP ROLE regress_tenant_b;
DROP ROLE regress_tenant_free;
