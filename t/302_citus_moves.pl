
# Copyright: the idempotency extension authors.
#
# 302_citus_moves.pl: on a Citus cluster (a coordinator and two workers),
# keys survive shard moves and node crashes, tokens keep increasing per key
# across them, and each node's background worker sweeps its own shards.
#
# What it proves:
#   - a shard moved (citus_move_shard_placement, logical replication)
#     while three clients claim and finish keys of its scope through the
#     coordinator loses no finished key (each is stored succeeded with the
#     token its client finished it with), never has two owners of a key
#     (each key is claimed once), and refuses the calls caught in the move's
#     switch-over only with 40001 (retryable): the keys they claimed are
#     finished afterwards with their tokens;
#   - a key's token keeps increasing when its shard moves to a node whose
#     token sequence is far behind: a key whose token is above the new
#     node's sequence and clock is taken over with a larger token, and so is
#     a key whose token died in a reset before the move;
#   - a worker stopped with -m immediate while a transaction block on the
#     coordinator holds an uncommitted claim there, then restarted: the
#     uncommitted claim is gone (the key is claimed again as attempt 1), a
#     committed pending key is still in progress and its owner finishes it,
#     a finished key replays, and tokens issued after the restart are larger
#     than those issued before;
#   - with the background worker on, each worker's sweeper resets stale
#     keys and deletes expired keys of the shards it holds (its own stats
#     count them) and the coordinator's, which holds no shard, sweeps
#     nothing.
#
# It skips itself when Citus is not installed for the PostgreSQL under test.
# The nodes listen on 127.0.0.1, ports 31616 to 31618.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemCitus;
use IdemTest;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $why = citus_available();
plan skip_all => $why if $why;

my $cluster     = citus_cluster(port => 31616, name => 'moves');
my $coordinator = $cluster->{coordinator};
my @workers     = @{ $cluster->{workers} };

sub coord { return $coordinator->safe_psql('postgres', $_[0]); }

coord('SELECT idempotency.distribute()');

# The other worker than $node.
sub other_worker
{
	my ($node) = @_;
	my ($other) = grep { $_->port != $node->port } @workers;
	return $other;
}

# Move the shard of $scope from the worker that holds it to the other one;
# returns (from, to).
sub move_scope
{
	my ($scope) = @_;
	my $from = shard_node_of($cluster, $scope);
	my $to   = other_worker($from);
	coord(
		    'SELECT citus_move_shard_placement('
		  . "get_shard_id_for_distribution_column('idempotency.keys', '$scope'), "
		  . "'127.0.0.1', " . $from->port . ", '127.0.0.1', " . $to->port . ", "
		  . "shard_transfer_mode => 'force_logical')");
	return ($from, $to);
}

# --- a move during a claim storm ------------------------------------------------

# Each client claims and finishes keys of scope "storm"; another client's
# key is in progress (or replays) when it comes to it.  Every claim it
# wins and every finish it makes is printed with its key and token.
my @storms;
for my $c (1 .. 3)
{
	my $script = "\\set VERBOSITY verbose\n\\pset format unaligned\n\\pset tuples_only on\n";
	for my $i (1 .. 5000)
	{
		my $key = 's' . (($i * 7 + $c * 13) % 6000);
		$script .= "\\unset t\n"
		  . "SELECT token AS t FROM idempotency.idem_claim('$key', scope => 'storm') \\gset\n"
		  . "\\if :{?t}\n"
		  . "\\echo claimed|$key|:t\n"
		  . "SELECT 'finished|$key|' || :t FROM idempotency.idem_finish('$key', :t, 200, scope => 'storm');\n"
		  . "\\endif\n";
	}
	my $file = "$PostgreSQL::Test::Utils::tmp_check/storm$c.sql";
	append_to_file($file, $script);
	my ($out, $err) = ('', '');
	my $h = IPC::Run::start(
		[
			'psql', '-X', '-q', '-h', $coordinator->host, '-p', $coordinator->port,
			'-d', 'postgres', '-f', $file
		],
		'<', \undef, '>', \$out, '2>', \$err);
	push @storms, { h => $h, out => \$out, err => \$err };
}

my ($storm_from, $storm_to);
ok( $coordinator->poll_query_until('postgres',
		"SELECT sum(claims) >= 300 FROM idempotency.cluster_stats"),
	'the storm is under way');
($storm_from, $storm_to) = move_scope('storm');
is(shard_node_of($cluster, 'storm')->port,
	$storm_to->port, 'the shard of the storm\'s scope moved to the other worker');
my $claims_at_move = coord('SELECT sum(claims) FROM idempotency.cluster_stats');
$_->{h}->finish for @storms;
cmp_ok(coord('SELECT sum(claims) FROM idempotency.cluster_stats'),
	'>', $claims_at_move, 'the storm went on after the move');

my (%claimed, %finished, @errors);
for my $s (@storms)
{
	for my $line (split /\n/, ${ $s->{out} })
	{
		my ($what, $key, $token) = split /\|/, $line;
		next unless defined $token;
		push @{ $claimed{$key} }, $token if $what eq 'claimed';
		$finished{$key} = $token if $what eq 'finished';
	}
	push @errors, ${ $s->{err} } =~ /ERROR:\s+([0-9A-Z]{5}):/g;
}
cmp_ok(scalar(keys %claimed), '>', 1000, 'the clients claimed over 1,000 keys');
is(scalar(grep { @{ $claimed{$_} } != 1 } keys %claimed),
	0, 'no key was claimed twice: never two owners');
is(scalar(grep { $_ ne '40001' } @errors), 0,
	'the only errors are 40001 (' . scalar(@errors) . ' calls caught in the switch-over)');

# Every finished key is stored as finished, with its token.
my $values = join(', ', map { "('$_', $finished{$_})" } sort keys %finished);
is( coord(
		    "SELECT count(*) FROM (VALUES $values) f(key, token) "
		  . 'LEFT JOIN idempotency.keys k ON k.scope = \'storm\' AND k.key = f.key '
		  . "WHERE k.status IS DISTINCT FROM 'succeeded' OR k.token IS DISTINCT FROM f.token"),
	'0',
	scalar(keys %finished) . ' finished keys, none lost');

# A claim whose finish was refused by the switch-over is still its
# client's: finished now, with its token.
my @unfinished = grep { !exists $finished{$_} } sort keys %claimed;
my $retried = 0;
for my $key (@unfinished)
{
	$retried++
	  if coord(
		"SELECT e IS NOT NULL FROM idempotency.idem_finish('$key', $claimed{$key}[0], 200, scope => 'storm') e"
	  ) eq 't';
}
is($retried, scalar(@unfinished),
	'the ' . scalar(@unfinished) . ' keys whose finish was refused are finished on retry');
is( coord(
		"SELECT count(*) FROM idempotency.keys WHERE scope = 'storm' AND status <> 'succeeded'"),
	'0',
	'every key of the storm is finished');

# --- tokens across a move to a node whose sequence is behind ----------------------

my $ahead = shard_node_of($cluster, 'ahead');
my $behind = other_worker($ahead);

# A key whose token dies in a reset before the move.
my $t_reset = coord(
	"SELECT token FROM idempotency.idem_claim('reset', scope => 'ahead', lease => '1 ms')");
wait_lease_over($coordinator, 'postgres', 'ahead', 'reset');
is(coord("SELECT reset FROM idempotency.idem_sweep()"), '1',
	'the sweep through the coordinator resets the key on its worker');
is(coord("SELECT token IS NULL FROM idempotency.keys WHERE scope = 'ahead' AND key = 'reset'"),
	't', 'its token died');

# A key whose token is above anything the other node's sequence or clock gives.
# With the library preloaded a node draws its tokens from a block reserved
# ahead, which a setval forward moves only at its next refill; after a
# restart the first token is above the sequence's position at once.
$ahead->safe_psql('postgres',
	"SELECT setval('idempotency.token_seq', 9000000000000000)");
$ahead->restart;
my $t_high = coord(
	"SELECT token FROM idempotency.idem_claim('high', scope => 'ahead', lease => '1 ms')");
cmp_ok($t_high, '>', 9000000000000000, 'a token from the node whose sequence is ahead');

my ($from, $to) = move_scope('ahead');
is($to->port, $behind->port, 'the shard moved to the node whose sequence is behind');
cmp_ok($behind->safe_psql('postgres', 'SELECT last_value FROM idempotency.token_seq'),
	'<', 9000000000000000, 'whose sequence is indeed behind');

wait_lease_over($coordinator, 'postgres', 'ahead', 'high');
my $row = coord(
	"SELECT outcome || ' ' || attempt || ' ' || token FROM idempotency.idem_claim('high', scope => 'ahead')");
my ($outcome, $attempt, $token) = split / /, $row;
is("$outcome $attempt", 'claimed 2', 'the key is taken over on its new node');
cmp_ok($token, '>', $t_high, 'with a larger token than it had');
$row = coord(
	"SELECT outcome || ' ' || attempt || ' ' || token FROM idempotency.idem_claim('reset', scope => 'ahead')");
($outcome, $attempt, $token) = split / /, $row;
is("$outcome $attempt", 'claimed 2', 'the reset key is claimed again on its new node');
cmp_ok($token, '>', $t_reset, 'with a larger token than its dead one');

# --- a worker crashes under an uncommitted claim ------------------------------------

my $victim = shard_node_of($cluster, 'crash');
my $t0 = coord("SELECT token FROM idempotency.idem_claim('pending', scope => 'crash')");
coord("SELECT token AS t FROM idempotency.idem_claim('done', scope => 'crash') \\gset\n"
	  . "SELECT idempotency.idem_finish('done', :t, 200, '\"ok\"', scope => 'crash')");
my $max_before = $victim->safe_psql('postgres',
	"SET citus.override_table_visibility = off;\n"
	  . "SELECT max(token) FROM idempotency.keys WHERE scope = 'crash'");

my $session = $coordinator->background_psql('postgres', on_error_stop => 0);
$session->query_safe('BEGIN');
is($session->query_safe(
		"SELECT outcome FROM idempotency.idem_claim('in-flight', scope => 'crash')"),
	'claimed', 'a transaction block holds an uncommitted claim on the worker');
ok( $victim->poll_query_until('postgres',
		"SELECT count(*) > 0 FROM pg_stat_activity WHERE state = 'idle in transaction' "
		  . "AND application_name LIKE 'citus_internal%'"),
	'the claim\'s transaction is open on the worker');
$victim->stop('immediate');
$victim->start;
$session->query('SELECT 1');    # the coordinator finds its connection gone
$session->query('ROLLBACK');
$session->quit;

$row = coord(
	"SELECT outcome || ' ' || attempt || ' ' || token FROM idempotency.idem_claim('in-flight', scope => 'crash')");
($outcome, $attempt, $token) = split / /, $row;
is("$outcome $attempt", 'claimed 1',
	'after the restart the uncommitted claim is gone: claimed again as attempt 1');
cmp_ok($token, '>', $max_before, 'with a token larger than any issued before the crash');
is(coord("SELECT outcome FROM idempotency.idem_claim('pending', scope => 'crash')"),
	'in_progress', 'the committed pending key is still in progress');
is( coord(
		"SELECT e IS NOT NULL FROM idempotency.idem_finish('pending', $t0, 200, scope => 'crash') e"),
	't', 'and its owner finishes it with its token');
is(coord("SELECT outcome || ' ' || response_body FROM idempotency.idem_claim('done', scope => 'crash')"),
	'replay "ok"', 'the finished key replays');

# --- each node's background worker sweeps its own shards ------------------------------

# Only this part's keys may come due while the sweepers run: the parts
# above claimed keys with the default 30 s lease, which a slow machine can
# see end by now, and a reset of one of them would count here too.
coord("DELETE FROM idempotency.keys WHERE scope NOT LIKE 'swept-%'");
my @scopes = map { "swept-$_" } 1 .. 40;
for my $scope (@scopes)
{
	coord("SELECT 1 FROM idempotency.idem_claim('stale', scope => '$scope', lease => '1 ms')");
	coord("SELECT 1 FROM idempotency.idem_claim('gone', scope => '$scope', lease => '1 ms', retention => '1 ms')");
}
my %stats_before = map {
	$_->port => $_->safe_psql('postgres',
		"SELECT reset || ' ' || expired FROM idempotency.stats WHERE database = current_database()")
} @workers;
for my $node (@{ $cluster->{nodes} })
{
	$node->safe_psql('postgres', "ALTER SYSTEM SET idempotency.sweep_interval = '50ms'");
	$node->safe_psql('postgres', 'SELECT pg_reload_conf()');
}
ok( $coordinator->poll_query_until('postgres',
		"SELECT count(*) = 0 FROM idempotency.keys WHERE scope LIKE 'swept-%' "
		  . "AND (key = 'gone' OR token IS NOT NULL)"),
	'the sweepers reset every stale key and delete every expired one');
for my $worker (@workers)
{
	my ($reset0, $expired0) = split / /, $stats_before{ $worker->port };
	my ($reset, $expired) = split / /,
	  $worker->safe_psql('postgres',
		"SELECT reset || ' ' || expired FROM idempotency.stats WHERE database = current_database()");
	my $mine = coord(
		"SELECT count(*) FROM unnest(ARRAY['" . join("','", @scopes) . "']) s "
		  . "JOIN pg_dist_placement p ON p.shardid = get_shard_id_for_distribution_column('idempotency.keys', s) "
		  . "JOIN pg_dist_node n USING (groupid) WHERE n.nodeport = " . $worker->port);
	cmp_ok($mine, '>', 0, $worker->name . ' holds some of the 40 scopes');
	is($reset - $reset0, $mine, $worker->name . '\'s sweeper reset its own stale keys');
	is($expired - $expired0, $mine, $worker->name . '\'s sweeper deleted its own expired keys');
}
is( coord(
		"SELECT reset || ' ' || expired FROM idempotency.stats WHERE database = current_database()"),
	'0 0',
	'the coordinator, which holds no shard, swept nothing');

citus_stop($cluster);
done_testing();
