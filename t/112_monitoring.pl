
# Copyright: the idempotency extension authors.
#
# 112_monitoring.pl: monitoring/queries.yaml, the postgres_exporter queries
# over the stats view, works as shipped.
#  - the file parses as YAML; every metric is LABEL, COUNTER or GAUGE and
#    has a description; the query's columns are exactly the metrics, in
#    order (postgres_exporter maps them by name);
#  - run as a monitoring role that has only USAGE on the schema, the query
#    answers one row for this database (label set, every counter and gauge
#    a number) and a row for another database that has counters, whose key
#    gauges are NULL (postgres_exporter leaves them out);
#  - the values are the view's: after known calls the counters and key
#    counts are what happened, keys_counts_exact is 1, and 0 once the
#    table is above idempotency.stats_exact_limit (the estimate after
#    ANALYZE is the same counts).
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).

use strict;
use warnings FATAL => 'all';

use CPAN::Meta::YAML;
use JSON::PP;
use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $file = "$FindBin::Bin/../monitoring/queries.yaml";
my $yaml = CPAN::Meta::YAML->read($file);
ok($yaml, 'queries.yaml parses') or diag(CPAN::Meta::YAML->errstr);
my $entry = $yaml->[0]{idempotency};
ok($entry && $entry->{query}, 'it defines the query "idempotency"');
my @metrics = map { [ %$_ ] } @{ $entry->{metrics} };
my @names = map { $_->[0] } @metrics;
foreach my $m (@metrics)
{
	my ($name, $def) = @$m;
	like($def->{usage}, qr/^(LABEL|COUNTER|GAUGE)$/, "$name: usage $def->{usage}");
	ok(length($def->{description} // ''), "$name: has a description");
}
is_deeply([ grep { $_->[1]{usage} eq 'LABEL' } @metrics ]->[0][0], 'database',
	'the one label is the database');

my $node = new_node('monitoring', port => 55453, extension => 1,
	conf => ['idempotency.sweep_interval = 0']);
sub sql { my ($sql, $db) = @_; return $node->safe_psql($db // 'postgres', $sql); }

sql(q{
CREATE ROLE regress_exporter LOGIN;
GRANT USAGE ON SCHEMA idempotency TO regress_exporter;
});
sql('CREATE DATABASE other');
install_extension($node, 'other');
sql("SELECT outcome FROM idempotency.idem_claim('o1')", 'other');

# Known calls: 4 claimed, 2 finished (succeeded), 1 replay, 1 mismatch.
# Two keys of each stored status: ANALYZE's statistics keep a value's
# frequency only when its sample holds the value twice or more.
my $t1 = claim($node, 'postgres', q{'k1', request => '{"a": 1}'})->{token};
my $t3 = claim($node, 'postgres', q{'k3'})->{token};
claim($node, 'postgres', q{'k2', lease => '1 hour'});
claim($node, 'postgres', q{'k4', lease => '1 hour'});
sql("SELECT idempotency.idem_finish('k1', $t1, 201)");
sql("SELECT idempotency.idem_finish('k3', $t3, 200)");
claim($node, 'postgres', q{'k1', request => '{"a": 1}'});
claim($node, 'postgres', q{'k1', request => '{"a": 2}'});

# The query as the exporter runs it, as a role with USAGE only: its column
# names in order, and each row by database.
sub scrape
{
	my $query = $entry->{query};
	my $out = $node->safe_psql('postgres',
		"SET ROLE regress_exporter;\n"
		  . "SELECT string_agg(j.k, ',' ORDER BY j.n) FROM (SELECT row_to_json(q) AS r "
		  . "FROM ($query) q LIMIT 1) s, json_each_text(s.r) WITH ORDINALITY AS j(k, v, n);\n"
		  . "SELECT row_to_json(q) FROM ($query) q");
	my ($header, @lines) = split /\n/, $out;
	my %rows;
	foreach my $line (@lines)
	{
		my $r = JSON::PP::decode_json($line);
		$rows{ $r->{database} } = { map { $_ => $r->{$_} // '' } keys %$r };
	}
	return ([ split /,/, $header ], \%rows);
}

# The SQL edition has no counters (NULL), and so no row for another
# database either (the view's other rows are databases that have counters)
# and no sweep times; its key gauges are real.
my $no_counters =
  'SQL edition: the stats counters and sweep times are NULL (they live in the C library\'s shared memory)';
my %usage = map { $_->[0] => $_->[1]{usage} } @metrics;

my ($cols, $rows) = scrape();
is_deeply($cols, \@names, 'the query\'s columns are the metrics, in order');
SKIP:
{
	skip $no_counters, 1 if sql_edition();
	ok($rows->{postgres} && $rows->{other}, 'a row for this database and for the other one');
}
my $me = $rows->{postgres};
foreach my $name (grep { $_ ne 'database' && $_ ne 'seconds_since_sweep' && $_ ne 'last_sweep_seconds' } @names)
{
	SKIP:
	{
		skip $no_counters, 1 if sql_edition() && $usage{$name} eq 'COUNTER';
		like($me->{$name}, qr/^-?\d+(\.\d+)?$/, "postgres: $name is a number ($me->{$name})");
	}
}
SKIP:
{
	skip $no_counters, 1 if sql_edition();
	is(join(',', @$me{qw(claims finishes replays mismatches)}), '4,2,1,1',
		'postgres: the counters are the calls made');
}
is(join(',', @$me{qw(pending succeeded failed keys_counts_exact)}), '2,2,0,1',
	'postgres: 2 pending, 2 succeeded, counted exactly');
is($me->{seconds_since_sweep}, '', 'postgres: no sweep yet, so no sweep age');
sql('SELECT * FROM idempotency.idem_sweep()');
($cols, $rows) = scrape();
SKIP:
{
	skip $no_counters, 3 if sql_edition();
	like($rows->{postgres}{seconds_since_sweep}, qr/^\d+(\.\d+)?$/,
		'postgres: after a sweep its age is a number of seconds');
	like($rows->{postgres}{last_sweep_seconds}, qr/^\d+(\.\d+)?$/, 'and so is its duration');
	is(join(',', @{ $rows->{other} }{qw(claims pending succeeded failed keys_counts_exact)}),
		'1,,,,', 'other: its counters, no key gauges (another database\'s table)');
}

# Above the exact limit: estimated, from the statistics of the last ANALYZE.
sql("ALTER SYSTEM SET idempotency.stats_exact_limit = 0; SELECT pg_reload_conf()");
sql('ANALYZE idempotency.keys');
my $ok = $node->poll_query_until('postgres',
	"SELECT current_setting('idempotency.stats_exact_limit') = '0'");
ok($ok, 'the new limit is in force');
($cols, $rows) = scrape();
is(join(',', @{ $rows->{postgres} }{qw(pending succeeded failed keys_counts_exact)}), '2,2,0,0',
	'postgres: above the limit the gauges are the estimate, keys_counts_exact 0');

$node->stop;
done_testing();
