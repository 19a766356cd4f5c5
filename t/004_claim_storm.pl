
# Copyright: the idempotency extension authors.
#
# 004_claim_storm.pl: many sessions claiming the same fresh keys at the same
# moment, preloaded and not.  pgbench runs 8 clients for 8 seconds; each
# transaction takes the next number of a sequence and claims key number/8,
# so about 8 clients race for every new key within microseconds: the case
# where a claim's lock-free probe found nothing and another session inserts
# the key before the claim gets the key's lock.  Three scripts, drawn at
# random: claim and finish at once (later racers see 'replay'); the same
# with wait => '1 s'; claim inside a transaction that rolls back (its row
# vanishes without ever being finished, and the racers that saw it busy
# answered in_progress).
#
# With the library preloaded, a claim skips its second probe when the key's
# write counter did not move (wait.c); this test is what fails, with a
# unique violation or two 'claimed' answers, if that shortcut ever skips a
# probe it needs: with the second probe always skipped, 8 seconds gave
# several duplicate-key errors in every trial.  It is a stress test: it
# cannot show that the shortcut is taken (the benchmark does).
#
# Checked: no transaction failed; per key at most one committed 'claimed',
# with attempt 1; every other answer in_progress or replay; the stored row
# is succeeded with the claimed token; tokens unique; no row left by a
# rolled-back claim.
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

# claim (with extra arguments), then finish at once if the claim won
my $claim_and_finish = <<'EOF';
SELECT nextval('storm_seq') / 8 AS k \gset
INSERT INTO storm_log SELECT :k, outcome, token, attempt FROM idempotency.idem_claim(:k::text, '{"n": 1}', :scope%s) RETURNING coalesce(token, 0) AS tok \gset
\if :tok > 0
SELECT idempotency.idem_finish(:k::text, :tok, 200, '{"ok": true}', :scope);
\endif
EOF
my $script      = sprintf($claim_and_finish, '');
my $script_wait = sprintf($claim_and_finish, ", wait => '1 s'");

my $script_rollback = <<'EOF';
SELECT nextval('storm_seq') / 8 AS k \gset
BEGIN;
SELECT outcome FROM idempotency.idem_claim(:k::text, '{"n": 1}', :scope);
ROLLBACK;
EOF

sub storm
{
	my ($node, $label) = @_;
	$node->safe_psql('postgres', q{
		CREATE SEQUENCE storm_seq;
		CREATE TABLE storm_log (k bigint, outcome text, token bigint, attempt int);
	});
	$node->pgbench(
		"--no-vacuum --protocol=prepared --client=8 --jobs=2 --time=8 --define=scope=storm",
		0,
		[qr{number of failed transactions: 0 }],
		[qr{^$}],
		"$label: 8 clients race for each fresh key, no transaction fails",
		{
			'storm'          => $script,
			'storm_wait'     => $script_wait,
			'storm_rollback' => $script_rollback
		});

	my $sql = sub { return $node->safe_psql('postgres', $_[0]); };
	my $keys = $sql->("SELECT count(DISTINCT k) FROM storm_log");
	cmp_ok($keys, '>', 200, "$label: over 200 keys were raced for");
	cmp_ok($sql->("SELECT count(*) FROM (SELECT k FROM storm_log GROUP BY k HAVING count(*) > 1) s"),
		'>', 100, "$label: over 100 keys had several claimers that committed");
	is($sql->("SELECT count(*) FROM (SELECT k FROM storm_log GROUP BY k "
			. "HAVING count(*) FILTER (WHERE outcome = 'claimed') > 1) s"),
		'0', "$label: at most one committed claimed answer per key");
	is($sql->("SELECT count(*) FROM storm_log WHERE outcome = 'claimed' AND attempt <> 1"),
		'0', "$label: every claim is attempt 1");
	is($sql->("SELECT count(*) FROM storm_log WHERE outcome NOT IN ('claimed', 'in_progress', 'replay')"),
		'0', "$label: the others got in_progress or replay");
	is($sql->("SELECT count(*) FROM storm_log WHERE outcome = 'claimed'"),
		$sql->("SELECT count(DISTINCT token) FROM storm_log WHERE outcome = 'claimed'"),
		"$label: tokens are unique");
	is($sql->(q{SELECT count(*) FROM storm_log l
		JOIN idempotency.keys s ON s.scope = 'storm' AND s.key = l.k::text
		WHERE l.outcome = 'claimed' AND (s.status <> 'succeeded' OR s.token <> l.token
			OR s.attempt <> 1 OR s.response_code <> 200)}),
		'0', "$label: each stored row holds the claimed token, attempt 1, the result");
	is($sql->("SELECT count(*) FROM idempotency.keys WHERE scope = 'storm'"),
		$sql->("SELECT count(*) FROM storm_log WHERE outcome = 'claimed'"),
		"$label: one stored row per committed claim, none from rolled-back claims");
	cmp_ok($sql->("SELECT count(*) FROM storm_log WHERE outcome = 'replay'"), '>', 0,
		"$label: some racers came after the finish (replay)");
}

my $node = new_node('storm', port => 55441, extension => 1);
storm($node, 'preloaded');
$node->stop;

my $plain = new_node('stormplain', port => 55442, preload => 0, extension => 1);
storm($plain, 'not preloaded');
$plain->stop;

done_testing();
