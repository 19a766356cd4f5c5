
# Copyright: the idempotency extension authors.
#
# 121_probe_hint_vacuum.pl: a connection remembers where it last wrote a
# key, and its next probe of that key reads that row version before the
# primary key.  A VACUUM can change what that place holds without the
# table getting a new file:
#   - it removes the version (deleted by a release) and frees its slot on
#     the page, which another key's row then takes: the probe must see
#     another key there and ask the index, which finds the key absent;
#   - it cuts the table's empty end off, and the remembered page with it:
#     the probe must not read past the table's end (an error "could not
#     read block") and must find the key absent.
# Each case runs in one session, so that the remembered place is that
# session's.  autovacuum is off, so that no other transaction keeps the
# deleted versions from being removed.  The row that takes the freed slot
# is written with plain SQL, which the extension's writer does not see.
# Run as described at the top of t/001_restart.pl.  Port 55463 only names
# the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition('the C library remembers where a connection last wrote a key; '
	  . 'the SQL edition reads keys through SQL statements');

my $node = new_node('hint', port => 55463,
	conf => ["autovacuum = off", "idempotency.sweep_interval = 0"],
	extension => 1);

# A slot freed by VACUUM and taken by another key's row.
my @out = split /\n/, $node->safe_psql('postgres', q{
SELECT token FROM idempotency.idem_claim('g0', scope => 'hint', lease => '1 hour') \gset g0_
SELECT token FROM idempotency.idem_claim('g1', scope => 'hint', lease => '1 hour') \gset g1_
SELECT ctid AS hinted FROM idempotency.keys WHERE scope = 'hint' AND key = 'g1' \gset
SELECT idempotency.idem_release('g1', :g1_token, 'hint');
VACUUM idempotency.keys;
INSERT INTO idempotency.keys
SELECT (jsonb_populate_record(NULL::idempotency.keys,
		to_jsonb(k) || '{"key": "g2"}')).*
  FROM idempotency.keys k WHERE scope = 'hint' AND key = 'g0';
SELECT ctid = :'hinted' FROM idempotency.keys WHERE scope = 'hint' AND key = 'g2';
SELECT outcome || ' ' || attempt || ' ' || (token > :g1_token)
  FROM idempotency.idem_claim('g1', scope => 'hint');
SELECT string_agg(key || ' ' || status || ' ' || attempt, ', ' ORDER BY key)
  FROM idempotency.keys WHERE scope = 'hint';
});
is($out[1], 't', "the released version's slot holds another key's row");
is($out[2], 'claimed 1 true',
	'a claim of the released key there finds it absent and claims it afresh');
is($out[3], 'g0 pending 1, g1 pending 1, g2 pending 1',
	'the other key is untouched, and the key is stored once');

# The remembered page cut off the table's end.  The keys fill a few pages
# of their own, the remembered one written last; all are released.
$node->safe_psql('postgres', q{DELETE FROM idempotency.keys; VACUUM idempotency.keys});
@out = split /\n/, $node->safe_psql('postgres', q{
CREATE TEMP TABLE tok AS
SELECT 'f' || i AS key, c.token
  FROM generate_series(1, 399) AS i,
	   LATERAL idempotency.idem_claim('f' || i, scope => 'fill', lease => '1 hour') AS c;
INSERT INTO tok
SELECT 'f400', token FROM idempotency.idem_claim('f400', scope => 'fill', lease => '1 hour');
SELECT (ctid::text::point)[0]::int AS hinted_block
  FROM idempotency.keys WHERE scope = 'fill' AND key = 'f400' \gset
SELECT :hinted_block > 0;
SELECT count(*) FROM tok, LATERAL (SELECT idempotency.idem_release(key, token, 'fill')) r;
DROP TABLE tok;
VACUUM idempotency.keys;
SELECT pg_relation_size('idempotency.keys') / current_setting('block_size')::int
	<= :hinted_block;
SELECT outcome || ' ' || attempt FROM idempotency.idem_claim('f400', scope => 'fill');
SELECT count(*) FROM idempotency.keys WHERE scope = 'fill';
});
is($out[0], 't', 'the keys fill more than one page');
is($out[1], '400', 'every key is released');
is($out[2], 't', 'the VACUUM cut the remembered page off');
is($out[3], 'claimed 1', 'a claim of the key then finds it absent and claims it');
is($out[4], '1', 'and stores it once');

$node->stop;
done_testing();
