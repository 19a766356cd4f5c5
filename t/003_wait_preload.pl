
# Copyright: the idempotency extension authors.
#
# 003_wait_preload.pl: idem_claim(wait => ...) with the library preloaded.
# A waiter must come back with the right outcome when the attempt it waits
# for settles: finish, release, commit or rollback of an open transaction,
# rollback to a savepoint, end of the lease; also after a crash restart
# (shared memory is set up again).  Nothing here measures time: the waits are
# long (2 minutes) and each case checks the outcome, attempt and token.
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
use Time::HiRes qw(usleep);

my $node = new_node('wait', port => 55443, conf => ['restart_after_crash = on'],
	extension => 1);

# How long a waiter waits at most: long enough never to be what ends a wait
# in these tests, short enough to fail (not hang) if a wake-up is lost.
my $wait = "'2 min'";

sub sql { return $node->safe_psql('postgres', $_[0]); }

# An open session that holds keys in a transaction.
sub session
{
	return $node->background_psql('postgres');
}

# Start "SELECT ... FROM idem_claim($args)" in a session of its own, and
# return once the backend sleeps in the claim's wait.
sub start_waiter
{
	my ($name, $args) = @_;
	my $s   = $node->background_psql('postgres', on_error_stop => 0);
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	my $buf = $s->query_until(qr/waiting\n/,
		"\\echo waiting\nSELECT $CLAIM_COLS FROM idempotency.idem_claim($args);\n\\echo done\n");
	my $w = { name => $name, s => $s, pid => $pid, buf => $buf };
	ok( $node->poll_query_until(
			'postgres',
			"SELECT $CLAIM_WAITING FROM pg_stat_activity "
			  . "WHERE pid = $pid"),
		"$name: the waiter sleeps in idem_claim");
	return $w;
}

# The waiter has not returned: its backend still runs the claim.
sub still_waiting
{
	my ($w, $why) = @_;
	$w->{s}{run}->pump_nb;
	unlike($w->{buf} . $w->{s}{stdout}, qr/done\n/, "$w->{name}: no result yet ($why)");
	is( sql("SELECT state FROM pg_stat_activity WHERE pid = $w->{pid}"),
		'active', "$w->{name}: still waiting ($why)");
}

# Non-blocking: the waiter's outcome row if it has returned, else undef.
sub poll_waiter
{
	my ($w) = @_;
	$w->{s}{run}->pump_nb;
	$w->{buf} .= $w->{s}{stdout};
	$w->{s}{stdout} = '';
	return undef unless $w->{buf} =~ /done\n/;
	my $text = $w->{buf};
	$text =~ s/^waiting\n//;
	$text =~ s/\n?done\n.*//s;
	# (lenient: a waiter that printed something else fails its checks.)
	return parse_claim($text, lenient => 1);
}

# Block until the waiter returns; its outcome row.
sub waiter_result
{
	my ($w) = @_;
	my $r = poll_waiter($w);
	unless (defined $r)
	{
		$w->{buf} .= $w->{s}->query_until(qr/done\n/, '');
		$r = poll_waiter($w);
	}
	$w->{s}->quit;
	diag("$w->{name}: stderr: $w->{s}{stderr}") if $w->{s}{stderr} ne '';
	return $r;
}

my $body     = q{'{"shipped": true}'};
my $body_md5 = body_md5($node, 'postgres', $body);

# --- the owner finishes (autocommit) ---------------------------------------
my $c = claim($node, 'postgres', "'finish', request => '{\"n\": 1}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'finish: owner claimed');
my $w = start_waiter('finish', "'finish', request => '{\"n\": 1}', wait => $wait");
still_waiting($w, 'the owner has not finished');
sql("SELECT idempotency.idem_finish('finish', $c->{token}, 200, $body)");
is_deeply(waiter_result($w), replay_row('succeeded', 200, $body_md5),
	'finish: the waiter replays the stored result');

# --- the owner fails (autocommit) ------------------------------------------
$c = claim($node, 'postgres', "'fail', lease => '1 hour'");
$w = start_waiter('fail', "'fail', wait => $wait");
sql("SELECT idempotency.idem_finish('fail', $c->{token}, 503, $body, status => 'failed')");
my $r = waiter_result($w);
is_deeply([ @$r{qw(outcome status response_code body_md5)} ],
	[ 'replay', 'failed', 503, $body_md5 ],
	'fail: the waiter replays the stored failure');

# --- the owner releases: the waiter claims a fresh first attempt ------------
$c = claim($node, 'postgres', "'release', request => '{\"n\": 2}', lease => '1 hour'");
$w = start_waiter('release', "'release', request => '{\"n\": 2}', lease => '1 hour', wait => $wait");
still_waiting($w, 'the owner has not released');
sql("SELECT idempotency.idem_release('release', $c->{token})");
$r = waiter_result($w);
is($r->{outcome}, 'claimed', 'release: the waiter claims the key');
is($r->{attempt}, 1,         'release: as a first attempt');
cmp_ok($r->{token}, '>', $c->{token}, 'release: with a larger token');
is( sql("SELECT status || ',' || token || ',' || attempt FROM idempotency.keys WHERE key = 'release'"),
	"pending,$r->{token},1", 'release: the stored row is the waiter\'s claim');

# --- an open transaction claims and finishes; the waiter returns at COMMIT --
my $o = session();
$o->query_safe('BEGIN');
my $oc = parse_claim($o->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('txn', request => '{\"n\": 4}', lease => '1 hour')"));
is($oc->{outcome}, 'claimed', 'txn: owner claimed in its transaction');
$w = start_waiter('txn', "'txn', request => '{\"n\": 4}', wait => $wait");
still_waiting($w, 'the owner\'s transaction is open');
$o->query_safe("SELECT idempotency.idem_finish('txn', $oc->{token}, 201, $body)");
still_waiting($w, 'the owner finished but has not committed');
$o->query_safe('COMMIT');
$r = waiter_result($w);
is_deeply([ @$r{qw(outcome status response_code body_md5 token)} ],
	[ 'replay', 'succeeded', 201, $body_md5, undef ],
	'txn: after the commit the waiter replays the committed result');

# --- an open transaction claims, then rolls back ----------------------------
$o->query_safe('BEGIN');
$oc = parse_claim($o->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('rollback', lease => '1 hour')"));
is($oc->{outcome}, 'claimed', 'rollback: owner claimed in its transaction');
$w = start_waiter('rollback', "'rollback', request => '{\"n\": 5}', lease => '1 hour', wait => $wait");
still_waiting($w, 'the owner\'s transaction is open');
$o->query_safe('ROLLBACK');
$r = waiter_result($w);
is($r->{outcome}, 'claimed', 'rollback: the waiter claims the key');
is($r->{attempt}, 1,         'rollback: as a first attempt');
cmp_ok($r->{token}, '>', $oc->{token}, 'rollback: with a token above the rolled-back one');

# --- ROLLBACK TO SAVEPOINT past the claim, the transaction stays open -------
$o->query_safe('BEGIN');
$o->query_safe('SAVEPOINT s1');
$oc = parse_claim($o->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('savepoint', lease => '1 hour')"));
is($oc->{outcome}, 'claimed', 'savepoint: owner claimed after a savepoint');
$w = start_waiter('savepoint', "'savepoint', lease => '1 hour', wait => $wait");
$o->query_safe('ROLLBACK TO SAVEPOINT s1');
$r = waiter_result($w);
is($r->{outcome}, 'claimed', 'savepoint: the waiter claims the key while the owner\'s transaction is still open');
is($r->{attempt}, 1,         'savepoint: as a first attempt');
cmp_ok($r->{token}, '>', $oc->{token}, 'savepoint: with a larger token');
$o->query_safe('COMMIT');
is( sql("SELECT token || ',' || attempt FROM idempotency.keys WHERE key = 'savepoint'"),
	"$r->{token},1", 'savepoint: the stored row is the waiter\'s claim');

# --- open transaction claims with another request: mismatch at COMMIT -------
$o->query_safe('BEGIN');
$oc = parse_claim($o->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('other', request => '{\"n\": 6}', lease => '1 hour')"));
$w = start_waiter('other', "'other', request => '{\"n\": 7}', wait => $wait");
still_waiting($w, 'the owner\'s transaction is open');
$o->query_safe('COMMIT');
$r = waiter_result($w);
is_deeply($r, mismatch_row(),
	'other: after the commit the waiter learns its request differs');

# --- committed claim without finish: the waiter takes over at the lease end -
$o->query_safe('BEGIN');
$oc = parse_claim($o->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('lease', request => '{\"n\": 8}', lease => '2 seconds')"));
$w = start_waiter('lease', "'lease', request => '{\"n\": 8}', lease => '1 hour', wait => $wait");
$o->query_safe('COMMIT');
$r = waiter_result($w);
is($r->{outcome}, 'claimed', 'lease: the waiter takes over when the lease ends');
is($r->{attempt}, 2,         'lease: as attempt 2');
cmp_ok($r->{token}, '>', $oc->{token}, 'lease: with a larger token');
$o->quit;
is( sql("SELECT idempotency.idem_finish('lease', $r->{token}, 200, $body) IS NOT NULL"),
	't', 'lease: the waiter finishes with its token');
is(sql("SELECT status || ',' || attempt FROM idempotency.idem_lookup('lease')"),
	'succeeded,2', 'lease: the key succeeded at attempt 2');

# --- two waiters: one claims after the release, the other replays -----------
$c = claim($node, 'postgres', "'two', lease => '1 hour'");
my $w1 = start_waiter('two-1', "'two', lease => '1 hour', wait => $wait");
my $w2 = start_waiter('two-2', "'two', lease => '1 hour', wait => $wait");
sql("SELECT idempotency.idem_release('two', $c->{token})");

my ($first, $second, $r1);
foreach (1 .. 1200)    # at most 2 minutes, the waiters' own limit
{
	if (defined($r1 = poll_waiter($w1))) { ($first, $second) = ($w1, $w2); last; }
	if (defined($r1 = poll_waiter($w2))) { ($first, $second) = ($w2, $w1); last; }
	usleep(100_000);
}
ok(defined $first, 'two: one waiter returns after the release');
SKIP:
{
	skip 'no waiter returned', 7 unless defined $first;
	$first->{s}->quit;
	is($r1->{outcome}, 'claimed', 'two: the first waiter back claims the key');
	is($r1->{attempt}, 1,         'two: as a first attempt');
	cmp_ok($r1->{token}, '>', $c->{token}, 'two: with a larger token');
	still_waiting($second, 'the other waiter\'s claim holds the key');
	sql("SELECT idempotency.idem_finish('two', $r1->{token}, 202, $body)");
	my $r2 = waiter_result($second);
	is_deeply([ @$r2{qw(outcome status response_code body_md5 token)} ],
		[ 'replay', 'succeeded', 202, $body_md5, undef ],
		'two: the other waiter replays the result of the first');
	is(sql("SELECT attempt FROM idempotency.idem_lookup('two')"), '1',
		'two: exactly one attempt ran');
}

# --- after a crash restart, waiters are still woken ------------------------
my $victim  = session();
my $vpid    = $victim->query_safe('SELECT pg_backend_pid()');
my $offset  = -s $node->logfile;
kill('KILL', $vpid);
$node->wait_for_log(
	qr/all server processes terminated; reinitializing.*database system is ready to accept connections/s,
	$offset);
eval { $victim->quit; };
ok($node->poll_query_until('postgres', 'SELECT 1', '1'),
	'crash: the server is back after reinitializing');

$o = session();
$o->query_safe('BEGIN');
$oc = parse_claim($o->query_safe(
	"SELECT $CLAIM_COLS FROM idempotency.idem_claim('after-crash', request => '{\"n\": 9}', lease => '1 hour')"));
is($oc->{outcome}, 'claimed', 'after-crash: owner claimed in its transaction');
$w = start_waiter('after-crash', "'after-crash', request => '{\"n\": 9}', wait => $wait");
still_waiting($w, 'the owner\'s transaction is open');
$o->query_safe("SELECT idempotency.idem_finish('after-crash', $oc->{token}, 200, $body)");
$o->query_safe('COMMIT');
$o->quit;
$r = waiter_result($w);
is_deeply([ @$r{qw(outcome status response_code body_md5)} ],
	[ 'replay', 'succeeded', 200, $body_md5 ],
	'after-crash: the waiter replays after the commit');

# No waiter is left behind.
is( sql("SELECT count(*) FROM pg_stat_activity WHERE $CLAIM_WAITING AND backend_type = 'client backend'"),
	'0', 'no backend is left waiting');

$node->stop;
done_testing();
