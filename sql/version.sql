--
-- idem_version(): the version of the loaded library, whose major.minor is
-- the extension version that CREATE EXTENSION installs with it (the SQL
-- edition, whose code is its SQL, registers each release as a version of
-- its own: there the two are equal)
--
SELECT idempotency.idem_version();
SELECT idempotency.idem_version() = '1.8.2' AS is_1_8_2;
SELECT extversion IN (idempotency.idem_version(),
                      substring(idempotency.idem_version() from '^[0-9]+\.[0-9]+')) AS names_extversion
  FROM pg_extension WHERE extname = 'idempotency';
