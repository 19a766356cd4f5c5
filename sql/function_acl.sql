-- Who may execute what.  PUBLIC may execute the documented client
-- functions and what the stats and cluster_stats views call, nothing else:
-- the sweep, the statistics reset, the binding functions, distribute and
-- the bindings table's trigger function are for the roles a DBA grants
-- them to, and any helper an edition has is for its own functions only.
-- The list is the same in both editions; a function executable by PUBLIC
-- that is not in it fails this test.
SELECT p.oid::regprocedure AS function
  FROM pg_proc p
 WHERE p.pronamespace = 'idempotency'::regnamespace
   AND (p.proacl IS NULL
        OR EXISTS (SELECT FROM aclexplode(p.proacl) a
                    WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))
 ORDER BY 1::text;
-- and a role with no grant of its own: the same list, seen from the role
CREATE ROLE regress_acl_nobody;
SELECT count(*) AS executable_by_nobody
  FROM pg_proc p
 WHERE p.pronamespace = 'idempotency'::regnamespace
   AND has_function_privilege('regress_acl_nobody', p.oid, 'EXECUTE');
DROP ROLE regress_acl_nobody;
