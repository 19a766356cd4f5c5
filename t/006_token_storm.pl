
# Copyright: the idempotency extension authors.
#
# 006_token_storm.pl: the holder of a claim calls with its token from many
# sessions at once.  A worker heartbeats its lease with idem_extend while
# another thread records progress with idem_checkpoint, and sweeps run next
# to them: every call is legal at any moment, so none may fail.  pgbench
# runs 8 clients for 10 seconds on 4 keys claimed with a 5-second lease;
# each transaction extends a key by 5 seconds (and logs the lease end the
# call returned), checkpoints it, or sweeps.  A key is due for a sweep when
# its first lease would have ended: the sweeps find it due while the lease
# still runs and reschedule it, so token calls meet a sweep's change in
# flight too.
#
# Races here: a token call reads the key while the previous call's change
# commits.  Each call commits after it has let go of the key's lock, so the
# next call can read the version that change replaced (in the SQL edition,
# a snapshot taken just before that commit); the write must then find the
# new version, not fail with "idempotency key changed during a write"
# (40001), and a call waiting for a change in flight must not make another
# call of the key refuse with 55P03.  Against an edition that has either
# defect, this load fails within a second.
#
# Checked: no transaction failed and pgbench printed no error; enough
# calls happened; each key is still pending, held by its first token at
# attempt 1; its stored lease end is the latest one any
# committed extend returned (no extend was lost); its phase and data come
# from the same checkpoint.
#
# Run as described at the top of t/001_restart.pl.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $keys = 4;

my $extend = <<'EOF';
\set k random(1, 4)
SELECT tok FROM storm_tokens WHERE k = :k \gset
INSERT INTO storm_log SELECT :k, idempotency.idem_extend('ts-' || :k, :tok, '5 seconds');
EOF

my $checkpoint = <<'EOF';
\set k random(1, 4)
\set n random(1, 1000000)
SELECT tok FROM storm_tokens WHERE k = :k \gset
SELECT idempotency.idem_checkpoint('ts-' || :k, :tok, 'step-' || :n, jsonb_build_object('n', :n));
EOF

my $sweep = <<'EOF';
SELECT * FROM idempotency.idem_sweep();
EOF

# Only the clients' sweeps run: the C edition's worker would also sweep,
# but at its own moments.
my $node = new_node('tokenstorm', port => 55458, extension => 1,
	conf => ['idempotency.sweep_interval = 0']);
my $sql = sub { return $node->safe_psql('postgres', $_[0]); };

$sql->(qq{
	CREATE TABLE storm_tokens (k int PRIMARY KEY, tok bigint NOT NULL);
	CREATE TABLE storm_log (k int NOT NULL, lease_until timestamptz NOT NULL);
	INSERT INTO storm_tokens
	SELECT k, (SELECT token FROM idempotency.idem_claim('ts-' || k, lease => '5 seconds'))
	  FROM generate_series(1, $keys) k;
});
is($sql->("SELECT count(*) FROM storm_tokens WHERE tok IS NOT NULL"),
	$keys, 'every key is claimed');

$node->pgbench(
	'--no-vacuum --protocol=simple --client=8 --jobs=2 --time=10',
	0,
	[qr{number of failed transactions: 0 }],
	[qr{^$}],
	'8 clients extend, checkpoint and sweep the same keys: no transaction fails',
	{
		'storm_extend@6'     => $extend,
		'storm_checkpoint@3' => $checkpoint,
		'storm_sweep@1'      => $sweep,
	});

cmp_ok($sql->("SELECT count(*) FROM storm_log"), '>', 2000,
	'over 2000 extends committed');
is( $sql->(q{
		SELECT count(*) FROM storm_tokens t
		  JOIN idempotency.keys s ON s.scope = '' AND s.key = 'ts-' || t.k
		 WHERE s.status = 'pending' AND s.token = t.tok AND s.attempt = 1}),
	$keys,
	'each key is pending, held by its first token at attempt 1');
is( $sql->(q{
		SELECT count(*) FROM idempotency.keys s
		  JOIN (SELECT k, max(lease_until) AS latest FROM storm_log GROUP BY k) l
		    ON s.scope = '' AND s.key = 'ts-' || l.k
		 WHERE s.lease_until = l.latest}),
	$keys,
	'each stored lease end is the latest one an extend returned');
is( $sql->(q{
		SELECT count(*) FROM idempotency.keys
		 WHERE key LIKE 'ts-%' AND phase = 'step-' || (phase_data ->> 'n')}),
	$keys,
	'each phase and its data come from the same checkpoint');

$node->stop;

done_testing();
